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

A step that raises part way poisons the optimizer until a checkpoint is loaded, as
StreamingAdam's does (``greenroom.optim.poison`` Note [a failed step poisons]).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.optim._muon import (  # noqa: PLC2701 (torch.optim.Muon's functional, no public name)
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    muon,
)

from greenroom.dirs.rankdir import RankDir
from greenroom.errors import ConfigError, GreenroomError
from greenroom.io.compression import ResolvedCodec
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL, BucketStore, Entry
from greenroom.optim.streamed import StreamedOptimizer, follow_param, listed_twice

_STREAMED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StreamingMuon(StreamedOptimizer):
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

    what = "StreamingMuon"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        state_dir: str | RankDir,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        moment_dtype: str = "fp32",
        chunk_mb: int = 256,
        host_cache_gb: float = 0.0,
        compression: str | ResolvedCodec = "auto",
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ConfigError("StreamingMuon: a tensor lr must have one element")
        if not 0.0 <= lr:
            raise ConfigError(f"StreamingMuon: invalid lr {lr!r}: must be >= 0")
        if not 0.0 <= momentum:
            raise ConfigError(f"StreamingMuon: invalid momentum {momentum!r}: must be >= 0")
        if not 0.0 <= weight_decay:
            raise ConfigError(f"StreamingMuon: invalid weight_decay {weight_decay!r}: must be >= 0")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ConfigError(
                f"StreamingMuon: adjust_lr_fn {adjust_lr_fn!r} is not supported (None, 'original' or 'match_rms_adamw')"
            )
        self._check_staging(chunk_mb, host_cache_gb)
        self._store: BucketStore | None = None
        self._failed: str | None = None  # optim.poison Note [a failed step poisons]
        self.streamed: list[torch.Tensor] = []
        self.frozen: set[int] = set()
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        super().__init__(params, defaults)
        entries = self._classify(range(len(self.param_groups)))
        self._record_groups()
        devices = {p.device for p in self.streamed}
        if len(devices) > 1:
            raise ConfigError(
                f"StreamingMuon: params are on several devices ({sorted(map(str, devices))}); "
                "one optimizer streams for one device"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        self._open_store(
            entries,
            state_dir,
            bucket_numel=bucket_numel,
            moment_dtype=moment_dtype,
            chunk_mb=chunk_mb,
            host_cache_gb=host_cache_gb,
            compression=compression,
            moments=1,
        )
        self.initialize_state()

    def _name(self, gi: int, pi: int) -> str:
        names = self.param_groups[gi].get("param_names")
        return f"{names[pi]!r} ({gi}.{pi})" if names else f"{gi}.{pi}"

    def _classify(self, group_indices: Iterable[int]) -> list[Entry]:
        entries = []
        for gi in group_indices:
            twice = listed_twice(self.param_groups[gi]["params"])
            if twice is not None:
                raise ConfigError(
                    f"StreamingMuon: param {self._name(gi, twice)} is listed twice in its group "
                    "(torch.optim.Muon steps it once); list it once"
                )
            for pi, p in enumerate(self.param_groups[gi]["params"]):
                if getattr(p, "device_mesh", None) is not None:
                    raise ConfigError(
                        f"StreamingMuon: param {self._name(gi, pi)} is a DTensor shard; Newton-Schulz "
                        "needs the whole matrix on one rank"
                    )
                if p.ndim != 2:
                    raise ConfigError(
                        f"StreamingMuon: param {self._name(gi, pi)} has size {tuple(p.shape)}; Muon only "
                        "supports 2D parameters (as torch.optim.Muon): give biases, norms and "
                        "embeddings to AdamW or StreamingAdam"
                    )
                if p.dtype not in _STREAMED_DTYPES:
                    raise ConfigError(
                        f"StreamingMuon: param {self._name(gi, pi)} is {p.dtype}; streaming supports "
                        "fp32, bf16 and fp16 params"
                    )
                if not p.requires_grad:
                    self.frozen.add(id(p))
                    continue
                if p.numel() == 0:
                    raise ConfigError(f"StreamingMuon: param {self._name(gi, pi)} has no elements")
                entries.append(
                    Entry(name=f"{gi}.{pi}", shape=tuple(p.shape), group=gi, master=p.dtype != torch.float32)
                )
                self.streamed.append(p)
        return entries

    # -- state ------------------------------------------------------------------------
    def initialize_state(self) -> None:
        """Fresh state: masters from the params, zero momentum."""
        with self._poisoned_if_it_fails("initialize_state()", "partly reset (some buckets fresh, some not)"):
            self.state.clear()
            self.store.initialize(lambda i: self.streamed[i])
        self._state_replaced()

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; after construction the new params' state goes in new buckets."""
        if self._store is not None:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            for p in params:
                if p.ndim != 2:
                    raise ConfigError(
                        f"StreamingMuon: a param of the new group has size {tuple(p.shape)}; Muon only "
                        "supports 2D parameters"
                    )
                if p.requires_grad and p.device != self.device:
                    raise ConfigError(
                        f"StreamingMuon: a param of the new group is on {p.device}, the others on "
                        f"{self.device}; one optimizer streams for one device"
                    )
        super().add_param_group(param_group)
        if self._store is not None:
            self._add_group_buckets()

    def state_dict(self) -> dict:
        """torch.optim.Muon's format, the tensors views of the bucket files."""
        from greenroom.optim.checkpoint.muon_state import export_state_dict

        return self._hooked_state_dict(export_state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Verify everything, then write bucket by bucket (``torch.optim.Muon``'s dicts load too)."""
        from greenroom.optim.checkpoint.muon_state import import_state_dict

        self._hooked_load_state_dict(state_dict, import_state_dict)

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

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        self._refuse_if_failed("step()")
        self._refuse_changed_groups()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if id(p) in self.frozen:
                    raise GreenroomError(
                        f"StreamingMuon: param {self._name(gi, pi)} has a grad but had "
                        "requires_grad=False when it was added, so it has no optimizer state: "
                        "to unfreeze it later, build the optimizer with it trainable (a param "
                        "whose grad is None is not stepped)"
                    )
                if torch.is_complex(p):
                    raise GreenroomError("StreamingMuon: Muon does not support complex parameters")
                if p.grad.is_sparse:
                    raise GreenroomError("StreamingMuon: Muon does not support sparse gradients")
        self._streamed_step()
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
                follow_param(target, p)
                grad = grad_views[k].copy_(grad)
            self.state.setdefault(p, {})  # has a momentum buffer now, as in torch.optim.Muon's state
            todo.append((k, p))
            params.append(target)
            grads.append(grad)
            momenta.append(bufs[k])
        if params:
            muon(
                params,
                grads,
                momenta,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                ns_coefficients=group["ns_coefficients"],
                eps=group["eps"],
                ns_steps=group["ns_steps"],
                adjust_lr_fn=group["adjust_lr_fn"],
                has_complex=False,
            )
        if masters is not None:
            for k, p in todo:
                p.copy_(masters[k])
