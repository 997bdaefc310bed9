"""What the actor holds: the unique storages behind its params, grads, buffers and the
optimizer's resident state, as the trainer names them (``track()``).

Offloading works on storages, not tensors: two tensors that view one storage (a grad
that is a view into a DDP bucket, an FSDP2 shard inside its padded flat buffer) move
once, and every view stays valid because the storage object itself is kept. What the
trainer does not name is found by ``greenroom.actor.discovery``; tracking is a hint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from greenroom.tensors import local_tensor


@dataclass(kw_only=True, slots=True)
class Tracked:
    """One unit of device memory the actor owns: a storage (portable backend) or a run
    of live allocator blocks (torch_memory_saver)."""

    storage: torch.UntypedStorage
    """The storage object; kept so every tensor that views it stays valid."""

    nbytes: int
    """Its size when awake."""

    key: tuple = ()
    """Identity across sleeps (``("storage", impl)`` or ``("block", address, nbytes)``):
    where its bytes went last time, so unchanged bytes need not be written again."""

    dead: bool = False
    """Its contents are not needed (a consumed grad, a discarded tensor): not moved,
    zero-filled at wake."""

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def bytes_view(self) -> torch.Tensor:
        """A flat uint8 tensor over the whole storage (for the I/O layer)."""
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage, 0, (self.nbytes,))


def storage_key(storage: torch.UntypedStorage) -> tuple:
    return ("storage", storage._cdata)


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The one storage behind ``t``, or None where there is none to move: a sparse
    tensor (an ``nn.Embedding(sparse=True)`` grad: its indices and values are tensors
    only C++ holds), a meta tensor, a wrapper subclass without storage. Such a tensor
    stays resident and intact, tracked or found by the scan alike."""
    t = local_tensor(t)
    if t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # wrapper subclasses without storage
        return None


def _tensors_of(source) -> Iterator[torch.Tensor]:
    if isinstance(source, torch.nn.Module):
        for p in source.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from source.buffers()
    elif isinstance(source, torch.optim.Optimizer):
        for state in source.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value
    elif isinstance(source, torch.Tensor):
        yield source
    else:
        for item in source:
            yield from _tensors_of(item)


def collect(sources: Iterable) -> list[Tracked]:
    """The unique, non-empty storages behind ``sources`` (modules, optimizers, tensors
    or iterables of them), in a stable order (first seen first)."""
    seen: set[int] = set()
    out: list[Tracked] = []
    for source in sources:
        for t in _tensors_of(source):
            storage = storage_of(t.detach())
            if storage is None:
                continue
            key = storage._cdata
            if key in seen:
                continue
            seen.add(key)
            if storage.nbytes() > 0:
                out.append(Tracked(storage=storage, nbytes=storage.nbytes(), key=storage_key(storage)))
    return out
