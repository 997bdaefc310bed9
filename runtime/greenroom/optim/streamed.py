"""What every streaming optimizer (``StreamingAdam``, ``StreamingMuon``) does the same way
around its state, whatever its update rule: the bucket store and the claimed state dir,
the poison of a failed step, torch's state-dict hooks, checkpoints, the device scratch
and the lifetime.

A failed step poisons the optimizer (``optim.poison`` Note [a failed step poisons]).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from greenroom.dirs.rankdir import RankDir
from greenroom.dirs.statedir import claim_state_dir
from greenroom.errors import ConfigError
from greenroom.io.compression import ResolvedCodec, resolved
from greenroom.optim.poison import FailedStepPoison
from greenroom.optim.store.bucket_store import BucketStore, Entry
from greenroom.tensors import local_tensor
from greenroom.units import GB, MAX_GB, MIB


def listed_twice(params: list) -> int | None:
    """The index of the first param listed a second time in ``params``, or None (torch
    only warns of it; the state is laid out per listing, so it would be stepped twice)."""
    seen = set()
    for index, p in enumerate(params):
        if id(p) in seen:
            return index
        seen.add(id(p))
    return None


class StreamedOptimizer(FailedStepPoison, torch.optim.Optimizer):
    """The shared part of the streaming optimizers. A subclass names itself in ``what``
    (the first word of its messages), sets ``_store = None`` and ``_failed = None`` before
    ``torch.optim.Optimizer.__init__``, sorts its params into ``streamed`` (the param of
    each store entry) and then calls ``_open_store``."""

    what = "StreamedOptimizer"
    streamed: list[torch.Tensor]
    _store: BucketStore | None

    # -- construction -----------------------------------------------------------------
    def _check_staging(self, chunk_mb: int, host_cache_gb: float) -> None:
        if isinstance(chunk_mb, bool) or not isinstance(chunk_mb, int) or chunk_mb <= 0:
            raise ConfigError(f"{self.what}: chunk_mb must be a positive integer number of MiB, got {chunk_mb!r}")
        if (
            isinstance(host_cache_gb, bool)
            or not isinstance(host_cache_gb, (int, float))
            or not 0 <= host_cache_gb <= MAX_GB
        ):
            raise ConfigError(
                f"{self.what}: host_cache_gb must be a finite number of GB >= 0 and at most {MAX_GB:g} "
                f"(an exabyte), got {host_cache_gb!r}"
            )

    def _open_store(
        self,
        entries: list[Entry],
        state_dir: str | RankDir,
        *,
        bucket_numel: int,
        moment_dtype: str,
        chunk_mb: int,
        host_cache_gb: float,
        compression: str | ResolvedCodec,
        **store_options,
    ) -> None:
        """Resolve the codec (unless the run resolved it: a ``ResolvedCodec``), claim the
        state dir and lay out the bucket files of ``entries`` on ``self.device``."""
        self.compression = resolved(
            compression, cuda=self.device.type == "cuda", chunk_bytes=chunk_mb * MIB, what=self.what
        )
        self.compression_line = self.compression.line
        # Claimed last, once nothing else can refuse: a refused optimizer leaves no dir.
        self._state_dir = claim_state_dir(state_dir, name="optim", what=self.what)
        self.state_dir = self._state_dir.path
        try:
            self._store = BucketStore(
                entries,
                self.state_dir,
                bucket_numel=bucket_numel,
                moment_dtype=moment_dtype,
                device=self.device,
                chunk_bytes=chunk_mb * MIB,
                compression=self.compression.codec,
                host_cache_bytes=int(host_cache_gb * GB),
                **store_options,
            )
        except BaseException:
            self._state_dir.release()
            raise
        self._grad_scratch: torch.Tensor | None = None
        self._pending_checkpoint = None  # an InStepCheckpoint for the next step
        self.last_checkpoint = None  # the last in-step checkpoint written (bench figures)

    # -- facts ------------------------------------------------------------------------
    @property
    def store(self) -> BucketStore:
        assert self._store is not None, f"{self.what} is closed"
        return self._store

    @property
    def moment_dtype(self) -> str:
        return self.store.moment_dtype

    def _keyed(self) -> dict[str, torch.Tensor]:
        """Every param by ``group.index``: how checkpoints name it."""
        return {f"{gi}.{pi}": p for gi, group in enumerate(self.param_groups) for pi, p in enumerate(group["params"])}

    def resident_params(self) -> dict[str, torch.Tensor]:
        return self._keyed()

    # -- what the state was laid out for -------------------------------------------------
    fixed_group_keys: dict = {}  # group keys whose other values the step does not implement
    tensor_lr = True  # whether a group's lr may be a tensor

    def _record_groups(self) -> None:
        """Note the params of every group, as the streamed state is laid out for them."""
        self._laid_out = [tuple(map(id, group["params"])) for group in self.param_groups]

    def _refuse_changed_groups(self) -> None:
        """Before a step changes anything: a group whose params were added, removed or
        replaced in ``param_groups`` since the layout, or a group key set to a value the
        step does not implement, is a one-line error; stepping would leave the new params
        untrained (their state has no place in the files) or ignore the key, silently."""
        if len(self.param_groups) != len(self._laid_out):
            raise ConfigError(
                f"{self.what}: param_groups has {len(self.param_groups)} groups, the state was laid out "
                f"for {len(self._laid_out)}: add groups with add_param_group only, or build a new "
                "optimizer"
            )
        for gi, (group, ids) in enumerate(zip(self.param_groups, self._laid_out)):
            if tuple(map(id, group["params"])) != ids:
                raise ConfigError(
                    f"{self.what}: param_groups[{gi}]['params'] changed since the state was laid out "
                    "(a param added, removed or replaced there): new params go in with "
                    "add_param_group, or build a new optimizer for the new params"
                )
            for key, allowed in self.fixed_group_keys.items():
                if group.get(key, allowed) != allowed:
                    raise ConfigError(
                        f"{self.what}: param_groups[{gi}]['{key}'] is {group[key]!r}; only "
                        f"{key}={allowed!r} is supported: use torch.optim for it"
                    )
            if not self.tensor_lr and isinstance(group["lr"], torch.Tensor):
                raise ConfigError(f"{self.what}: param_groups[{gi}]['lr'] is a tensor; give a float")

    def _add_group_buckets(self) -> None:
        """The state of the group torch's ``add_param_group`` just appended, in new buckets
        (masters from the params, moments zero). A refusal (one between
        ``checkpoint_next_step`` and its step too), or a failure before a bucket is
        written (no space for its file), takes the group back out as if it was never added
        (``BucketStore.extend`` leaves no file); left in, its params would never be stepped.
        A failure while the new buckets are written poisons (Note [a failed step poisons])."""
        kept = {name: len(getattr(self, name)) for name in ("streamed", "resident", "empty") if hasattr(self, name)}
        frozen = set(self.frozen)
        try:
            if self._pending_checkpoint is not None:
                raise ConfigError(
                    f"{self.what}: add_param_group() between checkpoint_next_step() and step(): that "
                    "checkpoint has a file for each bucket there was; call it before "
                    "checkpoint_next_step()"
                )
            entries = self._classify([len(self.param_groups) - 1])
            new = self.store.extend(entries) if entries else []
        except BaseException:
            self.param_groups.pop()
            for name, length in kept.items():
                del getattr(self, name)[length:]
            self.frozen.intersection_update(frozen)
            raise
        self._record_groups()
        if new:
            with self._poisoned_if_it_fails("add_param_group()", "partly set up (the new group's buckets unwritten)"):
                self.store.overwrite(self._fresh_fill(), new)

    def _fresh_fill(self):
        """A ``BucketStore.overwrite`` fill: masters from the params, moments zero."""

        def fill(state) -> None:
            if state.master is None:
                return
            for i, view in zip(state.bucket.entries, state.views(state.master)):
                view.copy_(local_tensor(self.streamed[i]).detach())

        return fill

    # -- state dicts and checkpoints ----------------------------------------------------
    def _hooked_state_dict(self, export: Callable[[Any], dict]) -> dict:
        """``export(self)`` between the hooks torch's ``Optimizer.state_dict`` runs (a
        post hook may return a replacement); refused while poisoned."""
        self._refuse_if_failed("state_dict()")
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = export(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            hooked = hook(self, out)
            if hooked is not None:
                out = hooked
        return out

    def _hooked_load_state_dict(self, state_dict: dict, load: Callable[[Any, dict], None]) -> None:
        """``load(self, state_dict)`` between the hooks torch's ``Optimizer.load_state_dict``
        runs (a pre hook may return a replacement dict); it replaces the whole state."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            hooked = hook(self, state_dict)
            if hooked is not None:
                state_dict = hooked
        load(self, state_dict)
        self._state_replaced()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def save_checkpoint(self, path: str, *, verify: bool = False) -> dict:
        """Write the state to ``path`` (synchronously, atomically; a link or clone of the
        files where the filesystem can); see ``optim.checkpoint``. Returns what it moved.
        ``verify``: read linked or cloned files back before publishing (else
        ``verify_linked`` reads them after, ``"verify"`` in the result says when)."""
        from greenroom.optim.checkpoint.save_load import save_checkpoint

        self._refuse_if_failed("save_checkpoint()")
        return save_checkpoint(self, path, verify=verify)

    def verify_linked(self, path: str) -> int:
        """Read back the files the checkpoint at ``path`` shares with the live state (links
        or clones) against their checksum tables; ``CheckpointError`` names a bad one."""
        from greenroom.optim.checkpoint.save_load import verify_linked

        return verify_linked(self, path)

    def checkpoint_next_step(self, path: str) -> None:
        """Have the next ``step()`` write a checkpoint of its result at ``path`` from its
        own streaming pass (no extra read) and publish it when the step ends; see
        ``greenroom.optim.checkpoint.instep``. A later call replaces an unused request."""
        from greenroom.optim.checkpoint.instep import InStepCheckpoint

        if self._pending_checkpoint is not None:
            self._pending_checkpoint.abandon()
        self._pending_checkpoint = InStepCheckpoint(self, path)

    def load_checkpoint(self, path: str, no_load_optim: bool = False) -> None:
        """Restore the state saved at ``path``, verified first; see ``optim.checkpoint``."""
        from greenroom.optim.checkpoint.save_load import load_checkpoint

        load_checkpoint(self, path, no_load_optim=no_load_optim)
        self._state_replaced()  # every bucket, counter and group

    def load_hyperparameters(self, groups: list[dict]) -> None:
        for group, saved in zip(self.param_groups, groups):
            group.update(saved)

    # -- the step ---------------------------------------------------------------------
    def _streamed_step(self, update_resident: Callable[[], None] | None = None) -> None:
        """The step: ``update_resident`` (the state kept on the device) and every bucket
        holding a param with a grad streamed through ``_step_bucket`` (the subclass's
        update of one bucket), under the poison; the checkpoint ``checkpoint_next_step``
        asked for is written from the same pass and published after it. A publish that
        fails raises, but leaves a whole step behind: no poison."""
        store = self.store
        needed = [b.index for b in store.buckets if any(self.streamed[i].grad is not None for i in b.entries)]
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        try:
            with self._poisoned_if_it_fails():
                if update_resident is not None:
                    update_resident()
                for bucket_state in store.stream(needed, checkpoint=pending):
                    self._step_bucket(bucket_state)
                if pending is not None:  # its publish follows: the step's own write-backs first,
                    store.engine.drain()  # and a failure there is the step's (else they overlap what follows)
        except BaseException:
            if pending is not None:
                pending.abandon()
            raise
        if pending is not None:
            pending.publish()
            self.last_checkpoint = pending

    def _step_bucket(self, bucket_state) -> None:
        raise NotImplementedError

    # -- device memory -----------------------------------------------------------------
    def _grads_for(self, numel: int) -> torch.Tensor:
        """fp32 grads for a bucket's fp32 masters, on the device (one scratch, the size of
        the largest bucket with masters)."""
        if self._grad_scratch is None or self._grad_scratch.numel() < numel:
            largest = max(b.numel for b in self.store.buckets if b.master is not None)
            self._grad_scratch = torch.empty(largest, dtype=torch.float32, device=self.device)
        return self._grad_scratch[:numel]

    def device_bytes(self) -> int:
        """Device memory the streaming holds between steps: the store's bucket buffers
        and the fp32 grad scratch (state kept resident is in ``self.state``)."""
        scratch = 0 if self._grad_scratch is None else self._grad_scratch.numel() * 4
        return (self._store.device_bytes() if self._store is not None else 0) + scratch

    def release_device_memory(self) -> int:
        """Give back ``device_bytes()``: between steps those buffers hold nothing the
        bucket files lack, and the next step makes them again. The offloader calls this
        on a tracked optimizer before the actor sleeps, so they are neither moved nor
        kept. Returns the bytes given back."""
        freed = self.device_bytes()
        if self._store is not None:
            self._store.release_device_buffers()
        self._grad_scratch = None
        return freed

    # -- lifetime ---------------------------------------------------------------------
    def close(self, *, write_back: bool = True) -> None:
        """Drain I/O and release the files and device buffers. The files go with the rank
        dir: at once when ``state_dir`` was a plain path, else when the ``RankDir`` closes.
        ``write_back``: see ``BucketStore.close``."""
        if self._store is not None:
            if self._pending_checkpoint is not None:
                self._pending_checkpoint.abandon()
                self._pending_checkpoint = None
            store, self._store = self._store, None
            try:
                store.close(write_back=write_back)
            finally:
                self._grad_scratch = None
                self._state_dir.release()

    def __del__(self) -> None:
        # Dropped unclosed: the store's I/O threads would outlive it. Nothing is written
        # back: no one can open these files again, and new I/O from a garbage collection,
        # which may run on one of the engine's own threads, could wait on itself forever.
        if getattr(self, "_store", None) is not None:
            self.close(write_back=False)


_FOLLOW_PIECE = 1 << 24  # elements per piece of the masters-follow-the-params check


def follow_param(master: torch.Tensor, param: torch.Tensor) -> None:
    """Re-seed the elements of ``master`` whose cast no longer equals ``param``; see
    Note [masters follow the params] of ``optim.adam``. In pieces, so the temporaries (7 B per element)
    stay small next to an embedding of a billion elements."""
    flat_master, flat_param = master.view(-1), param.reshape(-1)
    for start in range(0, flat_master.numel(), _FOLLOW_PIECE):
        m = flat_master[start : start + _FOLLOW_PIECE]
        q = flat_param[start : start + _FOLLOW_PIECE]
        torch.where(q != m.to(q.dtype), q.to(m.dtype), m, out=m)
