"""Host memory for the buckets of the host cache (``optim.store.held`` Note [host cache]).

``host_memory`` hands out page-aligned anonymous memory, pinned for CUDA when asked;
``HostCopy`` is what ``BucketStore.stream`` waits on for a copy between a device buffer
and that memory, as it waits on the engine's ``Transfer`` for a file.
"""

from __future__ import annotations

import mmap

import torch

from greenroom.errors import StorageError
from greenroom.io.fs import human_bytes


class HostCopy:
    """A copy between a device buffer and the host cache, as ``stream`` waits for it
    (the engine's ``Transfer`` for a file). A read lets the caller's stream go on once
    the bytes are in; a write-back blocks the host until the device buffer is free."""

    __slots__ = ("event", "stream")

    def __init__(self, event=None, stream=None) -> None:
        self.event, self.stream = event, stream  # None: a synchronous (CPU) copy, already over

    def wait(self) -> None:
        if self.event is None:
            return
        if self.stream is not None:
            self.stream.wait_event(self.event)
        else:
            self.event.synchronize()


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch registers


def host_memory(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of page-aligned anonymous host memory as a uint8 tensor, registered with
    CUDA (pinned) when ``pin``. Not torch's pinned allocator, which rounds each
    allocation up to a power of two (a 2.4 GB bucket would take 4.3 GB); and not
    torch-owned, so actor offload on a CPU device leaves it in place, as it does the
    engine's own memory."""
    memory = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    if pin:
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
        if code != 0:
            raise StorageError(
                f"--stream-optimizer-state-host-cache-gb: pinning {human_bytes(nbytes)} of host memory "
                f"failed (CUDA error {code}); use a smaller host cache"
            )
    return tensor


def unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
