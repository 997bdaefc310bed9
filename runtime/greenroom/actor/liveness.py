"""Which of the actor's bytes are dead: not worth moving, coming back zero-filled.

Two sources, both decided per storage and both conservative (when in doubt, move):

Consumed grads
    A hook after every optimizer step (``register_optimizer_step_post_hook``, so every
    optimizer counts, tracked or not) records each grad it read, with the grad's
    version counter. At sleep a grad storage is dead when its recorded views cover
    the whole storage and none was written since (the version is unchanged: a backward
    that accumulated into it, a DDP all-reduce into its bucket or ``zero_()`` all bump
    it, since views share their base's counter). A sleep between backward and step, or
    in the middle of gradient accumulation, finds the grads written after the last
    step: they move. ``zero_grad(set_to_none=True)`` leaves no grad to think about.
    A write that bumps no counter (through ``.data``, numpy, DLPack) is not seen: a
    known limit (docs/offload.md says why a per-step fingerprint is not the answer).
Discarded tensors
    ``Offloader.discard(t)``: the trainer says the next sleep need not keep ``t``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from greenroom.errors import ConfigError
from greenroom.tensors import local_tensor


@dataclass(slots=True)
class _Record:
    nbytes: int
    data_ptr: int
    views: list = field(default_factory=list)  # (weakref to tensor, version, start, end)

    def still_dead(self, storage: torch.UntypedStorage) -> bool:
        if storage.nbytes() != self.nbytes:
            return False
        alive = [(t, version, start, end) for ref, version, start, end in self.views if (t := ref()) is not None]
        if not alive or any(
            t._version != version or t.untyped_storage()._cdata != storage._cdata for t, version, _, _ in alive
        ):
            return False
        covered = 0
        for _, _, start, end in sorted(self.views, key=lambda v: v[2]):  # views of dead refs still wrote nothing
            if start > covered:
                return False
            covered = max(covered, end)
        return covered >= self.nbytes


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    if not t.is_contiguous():
        return None
    start = t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


class Liveness:
    """Dead storages of the actor, keyed by storage; see the module docstring."""

    def __init__(self) -> None:
        self._consumed: dict[int, _Record] = {}
        self._discarded: dict[int, _Record] = {}
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        consumed: dict[int, _Record] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for grad in (p.grad, getattr(p, "main_grad", None)):
                    if isinstance(grad, torch.Tensor):
                        self._note(consumed, local_tensor(grad))
        # Only the latest step's grads: a param this step did not read keeps its grad.
        for key in [k for k, r in self._consumed.items() if any(ref() is None for ref, *_ in r.views)]:
            del self._consumed[key]
        self._consumed.update(consumed)

    @staticmethod
    def _note(records: dict[int, _Record], t: torch.Tensor) -> bool:
        span = _span(t)
        if span is None:
            return False
        storage = t.untyped_storage()
        record = records.setdefault(storage._cdata, _Record(nbytes=storage.nbytes(), data_ptr=storage.data_ptr()))
        record.views.append((weakref.ref(t), t._version, *span))
        return True

    def discard(self, tensors) -> None:
        for t in tensors:
            t = local_tensor(t)  # the object itself: a detached alias would die at once
            storage = t.untyped_storage()
            span = _span(t)
            if span != (0, storage.nbytes()):
                raise ConfigError(
                    "offloader.discard(): pass tensors that cover their whole storage "
                    f"(got a view of {span} of {storage.nbytes()} bytes); a part of a "
                    "storage cannot be dropped"
                )
            self._note(self._discarded, t)

    def dead(self, storage: torch.UntypedStorage) -> bool:
        for records in (self._discarded, self._consumed):
            record = records.get(storage._cdata)
            if record is not None and record.still_dead(storage):
                return True
        return False

    def dead_storages(self) -> list[torch.UntypedStorage]:
        """The storages dead now (for the allocator view, which sees addresses)."""
        out = []
        for records in (self._discarded, self._consumed):
            for record in records.values():
                alive = [t for ref, *_ in record.views if (t := ref()) is not None]
                if alive and record.still_dead(alive[0].untyped_storage()):
                    out.append(alive[0].untyped_storage())
        return out

    def woke(self) -> None:
        """A discard holds for one sleep; consumed grads stay dead until written."""
        self._discarded.clear()

    def close(self) -> None:
        self._handle.remove()
