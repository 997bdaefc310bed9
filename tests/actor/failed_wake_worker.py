"""A process that streams an optimizer step, lets the portable actor offload sleep with
scope ``all`` (it moves every storage gc reaches, greenroom's own included), fails the
wake and abandons the sleeping actor, then streams the same steps again in the same
process; used by tests/actor/test_failed_wake.py.

    python failed_wake_worker.py DIR

Prints ``identical: True`` when the steps after the failed wake give the same bits as
the steps before it. A greenroom module that cached a torch tensor across calls (such as
module-level fingerprint weights in ``greenroom.optim.remainder``) would have that tensor
moved out by the sleep and freed by the failed wake: the second run would then read freed
memory, a segfault (the worker dies by SIGSEGV) or wrong bits.

What the references are kept in matters: a torch tensor the worker holds during the
sleep is the actor's too and is freed with it, so they are numpy arrays (not tensors:
discovery never sees them).
"""

import os
import sys

import numpy as np
import torch

from greenroom import OffloadConfig, actor
from greenroom.io.engine import StateFile
from greenroom.optim import StreamingAdam


def stream_two_steps(directory: str) -> list[np.ndarray]:
    """bf16 params (masters stored as a remainder: the encode fingerprints every block)
    stepped twice with fixed grads; the params' bits afterwards."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(50_000, generator=gen).to(torch.bfloat16)) for _ in range(3)]
    opt = StreamingAdam(params, lr=1e-2, state_dir=directory, bucket_numel=60_000, chunk_mb=1, resident_numel=0)
    try:
        for _ in range(2):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        return [p.detach().view(torch.int16).numpy().copy() for p in params]
    finally:
        opt.close()


def fail_a_wake(directory: str) -> None:
    """An actor (a model) sleeps with scope ``all``; every read of the wake fails, and the
    offloader is closed asleep: whatever the sleep moved out stays freed."""
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))
    config = OffloadConfig(
        offload_train=True, offload_train_target="disk", offload_train_disk_dir=directory, offload_train_disk_chunk_mb=1
    )
    offloader = actor.build_offloader(config, directory, scope="all").track(model)
    offloader.sleep()
    real_read = StateFile.read

    def failing_read(self, buf, offset):
        raise OSError(5, "Input/output error (injected)")

    StateFile.read = failing_read
    try:
        offloader.wake()
        raise AssertionError("the wake did not fail")
    except OSError:
        pass
    finally:
        StateFile.read = real_read
    assert offloader.is_asleep
    offloader.close()  # abandoned asleep: the actor's storages stay given back


def main() -> int:
    directory = sys.argv[1]
    before = stream_two_steps(os.path.join(directory, "before"))
    fail_a_wake(os.path.join(directory, "actor"))
    after = stream_two_steps(os.path.join(directory, "after"))
    print(f"identical: {all(np.array_equal(a, b) for a, b in zip(before, after))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
