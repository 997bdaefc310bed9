"""Finding every live allocation of the actor without being told.

Two views of "live", one per backend:

``python_storages`` (portable backend)
    Every storage behind a tensor Python can reach (``gc``): params, their grads,
    buffers, optimizer state, and whatever else the trainer keeps (a frozen reference
    policy, an EMA copy, a loose tensor), each storage once. What only C++ holds (the
    tensors autograd saved for a pending backward, library workspaces) is not seen; it
    stays resident and intact, and the backend says how much in one warning.
``allocator_runs`` (torch_memory_saver)
    Every live block of torch's caching allocator (its memory snapshot), outside the
    pools of other tags (the rollout), as runs of adjacent live blocks. The allocator's
    free cache is not live and is not moved.

Note [greenroom's own tensors]: ``python_storages`` sees storages, not who holds them,
so a torch tensor greenroom kept in a module global or a class attribute (a cache)
would be the actor's too: moved out by every sleep, and freed for good by a wake that
failed and was not retried, after which the next use in the process reads freed memory
(a segfault, for a cache such as fingerprint weights of ``greenroom.optim.remainder``). Telling
greenroom's internals apart by where they are referenced from would also take the
actor's state that greenroom holds for the trainer (a streaming optimizer's resident
moments), which must move. So greenroom keeps no torch-owned tensor beyond a call in a
module or class: small constants are made per call; what must stay put while the actor
sleeps is memory torch does not own (``io.engine``'s checksum tables, numpy-backed: not
resizable, so never moved) or is found by type (the I/O layer's ``StagingBuffers`` and
every ``HostMover``'s copies are skipped) or named (the rollout's storages, held in
``WeakStorages``).
tests/actor/test_failed_wake.py walks every module and class for it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable

import torch

from greenroom.actor.movers import HostMover
from greenroom.actor.tracking import Tracked, storage_key, storage_of
from greenroom.io.engine import StagingBuffers


def _on(device: torch.device, storage_device: torch.device) -> bool:
    if storage_device.type != device.type:
        return False
    return device.type != "cuda" or storage_device.index == (
        device.index if device.index is not None else torch.cuda.current_device()
    )


class WeakStorages:
    """A set of storages held weakly, by identity: an entry lasts exactly as long as its
    storage lives, whichever tensors or views of it come and go, and a new storage at a
    dead one's address is not a member. (torch keeps one Python object per live storage,
    so a weak reference to it dies with the storage, not with the tensor it came from.)
    Used for what is not the actor's (the rollout's storages) and for what was already
    live when the rollout region began."""

    def __init__(self, storages: Iterable[torch.UntypedStorage] = ()) -> None:
        self._refs: dict[int, weakref.ref] = {}
        for storage in storages:
            self.add(storage)

    def add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata

        def forget(ref: weakref.ref) -> None:
            if self._refs.get(key) is ref:  # not a newer storage at the same address
                del self._refs[key]

        self._refs[key] = weakref.ref(storage, forget)

    def nbytes_on(self, device: torch.device) -> int:
        """Bytes of the member storages on ``device``."""
        return sum(
            s.nbytes() for ref in list(self._refs.values()) if (s := ref()) is not None and _on(device, s.device)
        )

    def __contains__(self, storage: torch.UntypedStorage) -> bool:
        ref = self._refs.get(storage._cdata)
        return ref is not None and ref() is storage


def _scan() -> tuple[list[torch.Tensor], set[int]]:
    """One pass over the objects the garbage collector tracks: the tensors, and the
    storages of greenroom's own host memory, never the actor's: the I/O layer's staging
    buffers and every host mover's copies (those of other offloaders in the process
    too: another cpu-target actor's sleeping state must not be shrunk by this one)."""
    objects = gc.get_objects()
    # Classify types, not objects (a few hundred types against ~10^5 objects), and never
    # call isinstance on an object: some objects' __class__ has side effects.
    types = set(map(type, objects))
    tensor_types = {tp for tp in types if issubclass(tp, torch.Tensor)}
    own_types = {tp for tp in types if issubclass(tp, (StagingBuffers, HostMover))}
    tensors = [o for o in objects if type(o) in tensor_types]
    own: set[int] = set()
    for o in [o for o in objects if type(o) in own_types] if own_types else []:
        own.update(t.untyped_storage()._cdata for t in o.owned())
    return tensors, own


def live_tensors(tensors: list[torch.Tensor] | None = None) -> Iterable[torch.Tensor]:
    """Every tensor object Python can reach, and the grads of leaves (a grad has no
    Python object until someone asks for it)."""
    for obj in _scan()[0] if tensors is None else tensors:
        yield obj
        if obj.is_leaf and obj.requires_grad and obj.grad is not None:
            yield obj.grad
        main_grad = getattr(obj, "main_grad", None)  # megatron-core's grad buffer views
        if isinstance(main_grad, torch.Tensor):
            yield main_grad


def python_storages(device: torch.device, *, exclude: WeakStorages) -> list[Tracked]:
    """The unique non-empty storages on ``device`` behind every reachable tensor."""
    tensors, own = _scan()
    seen: set[int] = set()
    out: list[Tracked] = []
    for t in live_tensors(tensors):
        storage = storage_of(t)
        if storage is None or storage._cdata in seen:
            continue
        seen.add(storage._cdata)
        if storage.nbytes() == 0 or not _on(device, storage.device) or storage._cdata in own or storage in exclude:
            continue
        out.append(Tracked(storage=storage, nbytes=storage.nbytes(), key=storage_key(storage)))
    return out


def excluded_pools_of(tms, actor_tag: str) -> set[tuple[int, int]]:
    """The memory pools torch_memory_saver made for tags other than the actor's."""
    if getattr(tms, "_impl", None) is None:
        return set()  # no region entered yet: no pool but the default one
    pools = getattr(tms._impl, "_mem_pools", None)
    assert pools is not None, "torch_memory_saver's pools moved: greenroom supports 0.0.10"
    return {pool.id for key, pool in list(pools.items()) if key[0] != actor_tag}


def raw_device_bytes(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at a device address, owning nothing."""

    class _Span:
        __cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
            "strides": None,
        }

    with torch.cuda.device(device):
        return torch.as_tensor(_Span(), device=device)


def allocator_segments(device: torch.device, *, exclude_pools: set) -> list[dict]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [
        s
        for s in torch.cuda.memory_snapshot()
        if s["device"] == index and tuple(s.get("segment_pool_id", (0, 0))) not in exclude_pools
    ]


# Blocks this large are units of their own, so that one that does not change (a frozen
# reference policy's weight) is recognised as clean whatever its neighbours do; smaller
# neighbours are moved together (fewer, larger transfers).
OWN_UNIT_BYTES = 1 << 20


def allocator_runs(device: torch.device, *, exclude_pools: set, dead_addresses: set[int]) -> list[Tracked]:
    """The live blocks of the actor's segments, small neighbours joined into runs; a
    dead block (a consumed grad, a discarded tensor) is a unit of its own, marked dead."""
    out: list[Tracked] = []

    def emit(start: int, end: int, dead: bool) -> None:
        if end > start:
            view = raw_device_bytes(start, end - start, device)
            out.append(
                Tracked(
                    storage=view.untyped_storage(), nbytes=end - start, key=("block", start, end - start), dead=dead
                )
            )

    for segment in allocator_segments(device, exclude_pools=exclude_pools):
        address = segment["address"]
        run_start = run_end = None
        for block in segment["blocks"]:
            start = block.get("address", address)
            size = block["size"]
            address = start + size
            live = block["state"] == "active_allocated"
            alone = live and (start in dead_addresses or size >= OWN_UNIT_BYTES)
            if not live or alone:
                if run_start is not None:
                    emit(run_start, run_end, False)
                    run_start = None
                if alone:
                    emit(start, start + size, start in dead_addresses)
                continue
            if run_start is None:
                run_start = start
            run_end = start + size
        if run_start is not None:
            emit(run_start, run_end, False)
    return out
