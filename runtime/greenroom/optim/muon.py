"""``StreamingMuon``: ``torch.optim.Muon`` whose momentum (and fp32 masters) live in per-bucket files.

Which state streams, per param:

- fp32 params: the momentum buffer (4 B/param in fp32); the param is its own master.
- bf16/fp16 params: an fp32 master and the momentum (8 B/param); after its bucket's
  update the param gets the new master cast to its dtype (``torch.optim.Muon`` keeps a
  16-bit param's momentum in the param's dtype and updates the param itself; here the
  fp32 master is updated, as StreamingAdam does).

The update of each bucket is ``torch.optim._muon.muon``, the functional
``torch.optim.Muon.step`` calls, over the bucket's views: with fp32 params the results
are bit-identical to ``torch.optim.Muon``. Newton-Schulz needs a whole matrix, and the
store never splits an entry across buckets, so every param is whole in its bucket. Muon
takes 2-D params only; anything else is refused by name, as torch refuses it (1-D
params, and embeddings, which are 2-D but should not be given to it, go to AdamW or
``StreamingAdam``). FSDP2 shards are refused: a shard is not the whole matrix.

Muon keeps no step counter. ``self.state[p]`` exists (empty) for each param that has a
momentum buffer, as torch's ``state[p]["momentum_buffer"]`` does; a checkpoint records
those params with step 0.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterable

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, muon

from greenroom.compression import resolve as resolve_compression
from greenroom.config import GB, MIB
from greenroom.errors import ConfigError, GreenroomError
from greenroom.optim.adam import _follow_param
from greenroom.optim.store import DEFAULT_BUCKET_NUMEL, BucketStore, Entry
from greenroom.rankdir import RankDir
from greenroom.statedir import claim_state_dir
from greenroom.tensors import local_tensor

_STREAMED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StreamingMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` with its momentum streamed from per-bucket files.

    Args:
        params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
            adjust_lr_fn: as ``torch.optim.Muon`` (same defaults, same checks).
        state_dir, bucket_numel, moment_dtype, chunk_mb, host_cache_gb, compression: as
            ``StreamingAdam`` (``moment_dtype`` is the momentum's storage dtype).

    Params with ``requires_grad=False`` get no state and no files. ``state_dict()`` is
    torch's format (``momentum_buffer`` per param, plus ``master`` for 16-bit params),
    views of the bucket files; ``save_checkpoint``/``load_checkpoint`` and the in-step
    checkpoint (``checkpoint_next_step``) are StreamingAdam's.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: str | None = None, *,
                 state_dir: str | RankDir, bucket_numel: int = DEFAULT_BUCKET_NUMEL, moment_dtype: str = "fp32",
                 chunk_mb: int = 256, host_cache_gb: float = 0.0, compression: str = "auto") -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ConfigError("StreamingMuon: a tensor lr must have one element")
        if not 0.0 <= lr:
            raise ConfigError(f"StreamingMuon: invalid lr {lr!r}: must be >= 0")
        if not 0.0 <= momentum:
            raise ConfigError(f"StreamingMuon: invalid momentum {momentum!r}: must be >= 0")
        if not 0.0 <= weight_decay:
            raise ConfigError(f"StreamingMuon: invalid weight_decay {weight_decay!r}: must be >= 0")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ConfigError(f"StreamingMuon: adjust_lr_fn {adjust_lr_fn!r} is not supported "
                             "(None, 'original' or 'match_rms_adamw')")
        if isinstance(chunk_mb, bool) or not isinstance(chunk_mb, int) or chunk_mb <= 0:
            raise ConfigError(f"StreamingMuon: chunk_mb must be a positive integer number of MiB, got {chunk_mb!r}")
        if (isinstance(host_cache_gb, bool) or not isinstance(host_cache_gb, (int, float))
                or not 0 <= host_cache_gb < math.inf):
            raise ConfigError(f"StreamingMuon: host_cache_gb must be a finite number of GB >= 0, got {host_cache_gb!r}")
        self._store: BucketStore | None = None
        self.streamed: list[torch.Tensor] = []
        self.frozen: set[int] = set()
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        entries = self._classify(range(len(self.param_groups)))
        devices = {p.device for p in self.streamed}
        if len(devices) > 1:
            raise ConfigError(f"StreamingMuon: params are on several devices ({sorted(map(str, devices))}); "
                             "one optimizer streams for one device")
        self.device = devices.pop() if devices else torch.device("cpu")
        codec, self.compression_line = resolve_compression(compression, cuda=self.device.type == "cuda",
                                                           chunk_bytes=chunk_mb * MIB)
        # As StreamingAdam's (greenroom.statedir): claimed last, so a refused optimizer leaves no dir.
        self._state_dir = claim_state_dir(state_dir, name="optim", what="StreamingMuon")
        self.state_dir = self._state_dir.path
        try:
            self._store = BucketStore(entries, self.state_dir, bucket_numel=bucket_numel, moment_dtype=moment_dtype,
                                      device=self.device, chunk_bytes=chunk_mb * MIB, compression=codec,
                                      host_cache_bytes=int(host_cache_gb * GB), moments=1)
        except BaseException:
            self._state_dir.release()
            raise
        self._grad_scratch: torch.Tensor | None = None
        self._pending_checkpoint = None  # an InStepCheckpoint for the next step
        self.last_checkpoint = None
        self.initialize_state()

    def _name(self, gi: int, pi: int) -> str:
        names = self.param_groups[gi].get("param_names")
        return f"{names[pi]!r} ({gi}.{pi})" if names else f"{gi}.{pi}"

    def _classify(self, group_indices: Iterable[int]) -> list[Entry]:
        entries = []
        for gi in group_indices:
            for pi, p in enumerate(self.param_groups[gi]["params"]):
                if getattr(p, "device_mesh", None) is not None:
                    raise ConfigError(f"StreamingMuon: param {self._name(gi, pi)} is a DTensor shard; Newton-Schulz "
                                     "needs the whole matrix on one rank")
                if p.ndim != 2:
                    raise ConfigError(f"StreamingMuon: param {self._name(gi, pi)} has size {tuple(p.shape)}; Muon only "
                                     "supports 2D parameters (as torch.optim.Muon): give biases, norms and "
                                     "embeddings to AdamW or StreamingAdam")
                if p.dtype not in _STREAMED_DTYPES:
                    raise ConfigError(f"StreamingMuon: param {self._name(gi, pi)} is {p.dtype}; streaming supports "
                                     "fp32, bf16 and fp16 params")
                if not p.requires_grad:
                    self.frozen.add(id(p))
                    continue
                if p.numel() == 0:
                    raise ConfigError(f"StreamingMuon: param {self._name(gi, pi)} has no elements")
                entries.append(Entry(name=f"{gi}.{pi}", shape=tuple(p.shape), group=gi,
                                     master=p.dtype != torch.float32))
                self.streamed.append(p)
        return entries

    # -- facts ------------------------------------------------------------------------
    @property
    def store(self) -> BucketStore:
        assert self._store is not None, "StreamingMuon is closed"
        return self._store

    @property
    def moment_dtype(self) -> str:
        return self.store.moment_dtype

    def _keyed(self) -> dict[str, torch.Tensor]:
        return {f"{gi}.{pi}": p for gi, group in enumerate(self.param_groups) for pi, p in enumerate(group["params"])}

    # -- state ------------------------------------------------------------------------
    def initialize_state(self) -> None:
        """Fresh state: masters from the params, zero momentum."""
        self.state.clear()
        self.store.initialize(lambda i: self.streamed[i])

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; after construction the new params' state goes in new buckets."""
        if self._store is not None:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            for p in params:
                if p.ndim != 2:
                    raise ConfigError(f"StreamingMuon: a param of the new group has size {tuple(p.shape)}; Muon only "
                                     "supports 2D parameters")
                if p.requires_grad and p.device != self.device:
                    raise ConfigError(f"StreamingMuon: a param of the new group is on {p.device}, the others on "
                                     f"{self.device}; one optimizer streams for one device")
        super().add_param_group(param_group)
        if self._store is None:
            return
        entries = self._classify([len(self.param_groups) - 1])
        if entries:
            new = self.store.extend(entries)

            def fill(state) -> None:
                if state.master is not None:
                    for i, view in zip(state.bucket.entries, state.views(state.master)):
                        view.copy_(self.streamed[i].detach())
            self.store.overwrite(fill, new)

    def state_dict(self) -> dict:
        """torch.optim.Muon's format, the tensors views of the bucket files."""
        from greenroom.optim.muon_state import export_state_dict

        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = export_state_dict(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            hooked = hook(self, out)
            if hooked is not None:
                out = hooked
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Verify everything, then write bucket by bucket (``torch.optim.Muon``'s dicts load too)."""
        from greenroom.optim.muon_state import import_state_dict

        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            hooked = hook(self, state_dict)
            if hooked is not None:
                state_dict = hooked
        import_state_dict(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def save_checkpoint(self, path: str) -> dict:
        from greenroom.optim.checkpoint import save_checkpoint

        return save_checkpoint(self, path)

    def load_checkpoint(self, path: str, no_load_optim: bool = False) -> None:
        from greenroom.optim.checkpoint import load_checkpoint

        load_checkpoint(self, path, no_load_optim=no_load_optim)

    def checkpoint_next_step(self, path: str) -> None:
        """Write a checkpoint at ``path`` as part of the next ``step()``'s own pass; see
        ``greenroom.optim.instep``."""
        from greenroom.optim.instep import InStepCheckpoint

        if self._pending_checkpoint is not None:
            self._pending_checkpoint.abandon()
        self._pending_checkpoint = InStepCheckpoint(self, path)

    # -- what a checkpoint reads (optim.checkpoint.StreamedState) -----------------------
    def keyed_params(self) -> dict[str, torch.Tensor]:
        ours = {id(p) for p in self.streamed}
        return {key: p for key, p in self._keyed().items() if id(p) in ours}

    def resident_state(self) -> dict[str, dict[str, torch.Tensor]]:
        # Which params have a momentum buffer (Muon counts no steps: 0 marks them).
        return {key: {"step": torch.tensor(0.0)} for key, p in self._keyed().items() if p in self.state}

    def load_resident_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        params = self._keyed()
        self.state.clear()
        for key in state:
            self.state[params[key]] = {}

    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k not in ("params", "param_names")} for group in self.param_groups]

    def load_hyperparameters(self, groups: list[dict]) -> None:
        for group, saved in zip(self.param_groups, groups):
            group.update(saved)

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if id(p) in self.frozen:
                    raise GreenroomError(f"StreamingMuon: param {self._name(gi, pi)} has a grad but had "
                                         "requires_grad=False when it was added, so it has no optimizer state")
                if torch.is_complex(p):
                    raise GreenroomError("StreamingMuon: Muon does not support complex parameters")
                if p.grad.is_sparse:
                    raise GreenroomError("StreamingMuon: Muon does not support sparse gradients")
        store = self.store
        needed = [b.index for b in store.buckets if any(self.streamed[i].grad is not None for i in b.entries)]
        pending, self._pending_checkpoint = self._pending_checkpoint, None  # checkpoint_next_step's
        with pending.during_step() if pending is not None else contextlib.nullcontext():
            for bucket_state in store.stream(needed, checkpoint=pending):
                self._step_bucket(bucket_state)
        if pending is not None:
            self.last_checkpoint = pending
        return loss

    def _step_bucket(self, bucket_state) -> None:
        bucket = bucket_state.bucket
        group = self.param_groups[self.store.entries[bucket.entries[0]].group]
        masters = bucket_state.views(bucket_state.master) if bucket.master is not None else None
        grad_views = bucket_state.views(self._grads_for(bucket.numel)) if masters is not None else None
        bufs = bucket_state.views(bucket_state.exp_avg)
        params, grads, momenta, todo = [], [], [], []
        for k, i in enumerate(bucket.entries):
            p = self.streamed[i]
            if p.grad is None:
                continue
            grad = p.grad
            if masters is None:
                target = p
            else:
                target = masters[k]
                _follow_param(target, p)
                grad = grad_views[k].copy_(grad)
            self.state.setdefault(p, {})  # has a momentum buffer now, as in torch.optim.Muon's state
            todo.append((k, p))
            params.append(target)
            grads.append(grad)
            momenta.append(bufs[k])
        if params:
            muon(params, grads, momenta, lr=group["lr"], weight_decay=group["weight_decay"],
                 momentum=group["momentum"], nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
                 eps=group["eps"], ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"],
                 has_complex=False)
        if masters is not None:
            for k, p in todo:
                p.copy_(masters[k])

    def _grads_for(self, numel: int) -> torch.Tensor:
        if self._grad_scratch is None or self._grad_scratch.numel() < numel:
            largest = max(b.numel for b in self.store.buckets if b.master is not None)
            self._grad_scratch = torch.empty(largest, dtype=torch.float32, device=self.device)
        return self._grad_scratch[:numel]

    # -- device memory and lifetime ------------------------------------------------------
    def device_bytes(self) -> int:
        scratch = 0 if self._grad_scratch is None else self._grad_scratch.numel() * 4
        return (self._store.device_bytes() if self._store is not None else 0) + scratch

    def release_device_memory(self) -> int:
        freed = self.device_bytes()
        if self._store is not None:
            self._store.release_device_buffers()
        self._grad_scratch = None
        return freed

    def close(self) -> None:
        if self._store is not None:
            if self._pending_checkpoint is not None:
                self._pending_checkpoint.abandon()
                self._pending_checkpoint = None
            store, self._store = self._store, None
            try:
                store.close()
            finally:
                self._grad_scratch = None
                self._state_dir.release()

    def __del__(self) -> None:
        if getattr(self, "_store", None) is not None:
            self.close()
