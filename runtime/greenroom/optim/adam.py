"""``StreamingAdam``: AdamW whose fp32 masters and moments live in per-bucket files.

Which state streams, per param (of this rank's local shard, for FSDP2 DTensors):

- bf16/fp16 params: an fp32 master and both moments stream (12 B/param in fp32); after
  its bucket's update the param gets the new master cast to its dtype. A bf16 param's
  master is stored as its low 16 bits beside the param by default (``master_layout
  "remainder"``, ``greenroom.optim.remainder`` Note [remainder]): 10 B/param in fp32.
- fp32 params: both moments stream (8 B/param); the param is its own master.
- fp32 params of at most ``resident_numel`` elements (a router's expert_bias, an SSM's
  A_log): tiny, so their state stays on the device in ``self.state`` and the same
  kernel updates them without any I/O.

The step walks the buckets with ``BucketStore.stream`` and applies ``bucket_adam_step``
(torch's AdamW functional) to each; see docs/streaming.md.

Note [masters follow the params]: a 16-bit param's fp32 master is the truth only while
the param still equals the master cast to the param's dtype, which the step leaves true.
Anything else that writes the param (``model.load_state_dict`` after the optimizer was
built, ``p.data.copy_``, an EMA swap) breaks that, so each step compares, on the device
and per element, the param with the cast of its master before updating, and re-seeds
every element that differs from the param (the fp32 value of the param). An element the
outside write left equal in the param's dtype keeps its fp32 master bits; that is the
only information the param has. The cost is one cast and compare per element of the
params the step updates, no I/O. fp32 params are their own master and need no rule.
Masters stored as a remainder (the default for bf16 params) follow their params by
fingerprint instead: a block of 4096 elements whose params changed is re-seeded whole
(``greenroom.optim.remainder`` Note [remainder]); ``master_layout="fp32"`` keeps the
per-element rule above.

A step that raises part way poisons the optimizer until a checkpoint is loaded:
``greenroom.optim.poison`` Note [a failed step poisons].
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from greenroom.config import MASTER_LAYOUTS, OffloadConfig
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import ConfigError, GreenroomError
from greenroom.io.compression import ResolvedCodec
from greenroom.optim.kernel import FIXED_GROUP_KEYS, bucket_adam_step, choose_implementation, new_step
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL, BucketStore, Entry
from greenroom.optim.streamed import StreamedOptimizer, follow_param, listed_twice
from greenroom.tensors import local_tensor

# fp32 params up to this many elements keep their Adam state on the device (256 KiB per
# moment): expert biases and A_log vectors are far below it, weight matrices far above.
RESIDENT_NUMEL = 65_536
_STREAMED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class StreamingAdam(StreamedOptimizer):
    """AdamW (decoupled weight decay) with its state streamed from per-bucket files.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults;
            weight_decay 0.01). Groups carry every key AdamW's groups carry; ``amsgrad``,
            ``maximize``, ``capturable``, ``differentiable`` and a coupled weight decay
            are not implemented and are refused when set.
        state_dir: where the bucket files go: an open ``RankDir`` (a subdir of its own,
            ``optim/``), or a path: this rank's own rank dir is made under it,
            ``<path>/<job>/optim/rank<N>/``, locked for the optimizer's life (a second
            owner is refused), refused on tmpfs, and removed by ``close()``, at exit or
            by ``greenroom reclaim`` after a crash (``greenroom.dirs.statedir``).
        bucket_numel: elements per bucket (a larger param gets a bucket of its own).
        moment_dtype: storage dtype of both moments, ``greenroom.config.MOMENT_DTYPES``.
        chunk_mb: the pinned host staging of this optimizer's I/O, MiB.
        host_cache_gb: host memory (GB, 1e9 bytes) that keeps whole buckets off the disk
            (``--stream-optimizer-state-host-cache-gb``; ``BucketStore`` Note [host cache]).
        resident_numel: fp32 params of at most this many elements stay resident.
        fused, foreach: torch's AdamW implementation to use; default fused on CUDA,
            foreach on the CPU (torch.optim.AdamW defaults to foreach on CUDA and its
            per-tensor loop on the CPU: fused is the faster kernel for the one bucket). Bit-exactness holds against
            ``torch.optim.AdamW`` with the same choice. Recorded in the groups as given.
        compression: the lossless codec of the bucket files (``--offload-train-disk-compression``):
            ``auto`` (``nvcomp-ans`` where CUDA is up and nvCOMP loads, else none), ``none``,
            ``nvcomp-ans`` or ``zstd``; or the ``greenroom.io.compression.ResolvedCodec`` a run
            resolved once for this device and chunk. ``compression`` is what runs, and
            ``compression_line`` says which and why.
        master_layout: ``remainder`` (default): a bf16 param's fp32 master is stored as
            its low 16 bits beside the param, exactly (Note [remainder]); ``fp32``: the
            whole master. fp16 params always store the whole master.

    Params with ``requires_grad=False`` get no state and no files. ``state_dict()`` and
    ``load_state_dict()`` use torch's format, backed by the bucket files (see
    ``greenroom.optim.checkpoint.state_dict``).
    """

    what = "StreamingAdam"
    fixed_group_keys = FIXED_GROUP_KEYS
    tensor_lr = False  # as AdamW with foreach, which refuses a tensor lr

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dir: str | RankDir,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        moment_dtype: str = "fp32",
        chunk_mb: int = 256,
        host_cache_gb: float = 0.0,
        resident_numel: int = RESIDENT_NUMEL,
        fused: bool | None = None,
        foreach: bool | None = None,
        compression: str | ResolvedCodec = "auto",
        master_layout: str = "remainder",
    ) -> None:
        if isinstance(lr, torch.Tensor):
            raise ConfigError("StreamingAdam: lr as a tensor is not supported: give a float")
        if not 0.0 <= lr:
            raise ConfigError(f"StreamingAdam: invalid lr {lr!r}: must be >= 0")
        if not 0.0 <= eps:
            raise ConfigError(f"StreamingAdam: invalid eps {eps!r}: must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ConfigError(f"StreamingAdam: invalid betas[{i}] {beta!r}: must be in [0, 1)")
        if not 0.0 <= weight_decay:
            raise ConfigError(f"StreamingAdam: invalid weight_decay {weight_decay!r}: must be >= 0")
        self._check_staging(chunk_mb, host_cache_gb)
        if master_layout not in MASTER_LAYOUTS:
            raise ConfigError(
                f"StreamingAdam: master_layout must be one of {', '.join(MASTER_LAYOUTS)}, got {master_layout!r}"
            )
        self._store: BucketStore | None = None
        self._failed: str | None = None  # optim.poison Note [a failed step poisons]
        self.master_layout = master_layout
        self.resident_numel = resident_numel
        self.streamed: list[torch.Tensor] = []  # the param of each store entry
        self.resident: list[torch.Tensor] = []
        self.frozen: set[int] = set()  # ids of params with requires_grad=False: no state
        self.empty: list[torch.Tensor] = []  # empty FSDP2 shards: a step counter only, as AdamW keeps
        super().__init__(
            params,
            dict(
                lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach, fused=fused, **FIXED_GROUP_KEYS
            ),
        )
        entries = self._classify(range(len(self.param_groups)))
        self._record_groups()
        devices = {local_tensor(p).device for p in self.streamed + self.resident}
        if len(devices) > 1:
            raise ConfigError(
                f"StreamingAdam: params are on several devices ({sorted(map(str, devices))}); "
                "one optimizer streams for one device"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        self.fused, self.foreach = choose_implementation(self.device, fused=fused, foreach=foreach)
        self._open_store(
            entries,
            state_dir,
            bucket_numel=bucket_numel,
            moment_dtype=moment_dtype,
            chunk_mb=chunk_mb,
            host_cache_gb=host_cache_gb,
            compression=compression,
            params=lambda i: local_tensor(self.streamed[i]),
        )
        self.initialize_state()

    def _classify(self, group_indices: Iterable[int]) -> list[Entry]:
        """Sort the params of these groups into streamed, resident and frozen; the store
        entries of the streamed ones."""
        entries = []
        for gi in group_indices:
            twice = listed_twice(self.param_groups[gi]["params"])
            if twice is not None:
                raise ConfigError(
                    f"StreamingAdam: param {gi}.{twice} is listed twice in its group (AdamW steps it "
                    "once, with one state); list it once"
                )
            for pi, p in enumerate(self.param_groups[gi]["params"]):
                local = local_tensor(p)
                if p.dtype not in _STREAMED_DTYPES:
                    raise ConfigError(
                        f"StreamingAdam: param {gi}.{pi} is {p.dtype}; streaming supports fp32, bf16 and fp16 params"
                    )
                if not p.requires_grad:
                    self.frozen.add(id(p))
                    continue
                if local.numel() == 0:
                    self.empty.append(p)  # an empty shard (FSDP2 on more ranks than rows): no bytes
                    continue
                if p.dtype == torch.float32 and local.numel() <= self.resident_numel:
                    self.resident.append(p)
                    continue
                entries.append(
                    Entry(
                        name=f"{gi}.{pi}",
                        shape=tuple(local.shape),
                        group=gi,
                        master=p.dtype != torch.float32,
                        remainder=p.dtype == torch.bfloat16 and self.master_layout == "remainder",
                    )
                )
                self.streamed.append(p)
        return entries

    @classmethod
    def from_config(cls, params: Iterable, config: OffloadConfig, rank_dir: str | RankDir, **kwargs) -> "StreamingAdam":
        """Build from the seed's flags: moment dtype, master layout, chunk size, codec and host
        cache from ``config``; ``kwargs`` are the AdamW hyperparameters (and ``bucket_numel``
        etc.), and ``compression``: the codec the run resolved for the config (default: the
        config's choice, resolved here)."""
        if not config.stream_optimizer_state_to_disk:
            raise ConfigError("StreamingAdam.from_config: the config does not set --stream-optimizer-state-to-disk")
        return cls(
            params,
            state_dir=rank_dir,
            moment_dtype=config.stream_optimizer_state_moment_dtype,
            master_layout=config.stream_optimizer_state_master_layout,
            chunk_mb=config.offload_train_disk_chunk_mb,
            host_cache_gb=config.stream_optimizer_state_host_cache_gb,
            **{"compression": config.offload_train_disk_compression, **kwargs},
        )

    # -- state ------------------------------------------------------------------------
    def initialize_state(self) -> None:
        """Fresh state: masters from the params, zero moments, no steps taken."""
        with self._poisoned_if_it_fails("initialize_state()", "partly reset (some buckets fresh, some not)"):
            self.state.clear()
            self.store.initialize(lambda i: local_tensor(self.streamed[i]))
        self._state_replaced()

    def add_param_group(self, param_group: dict) -> None:
        """As torch's; after construction the new params' state goes in new buckets
        appended to the store (masters from the params, zero moments)."""
        for key, allowed in FIXED_GROUP_KEYS.items():
            if key in param_group and param_group[key] != allowed:
                raise ConfigError(
                    f"StreamingAdam: {key}={param_group[key]!r} is not supported "
                    f"(only {key}={allowed!r}); use torch.optim.AdamW for it"
                )
        if self._store is not None:  # checked before the group joins, so a refusal changes nothing
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}
            for p in params:
                if p.dtype not in _STREAMED_DTYPES:
                    raise ConfigError(
                        f"StreamingAdam: a param of the new group is {p.dtype}; streaming supports "
                        "fp32, bf16 and fp16 params"
                    )
                if p.requires_grad and local_tensor(p).device != self.device:
                    raise ConfigError(
                        f"StreamingAdam: a param of the new group is on {local_tensor(p).device}, "
                        f"the others on {self.device}; one optimizer streams for one device"
                    )
        super().add_param_group(param_group)
        if self._store is not None:  # else the constructor lays out every group at once
            self._add_group_buckets()

    def state_dict(self) -> dict:
        """torch's format, the tensors views of the bucket files; see
        ``greenroom.optim.checkpoint.state_dict``."""
        from greenroom.optim.checkpoint.state_dict import export_state_dict

        return self._hooked_state_dict(export_state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Verify everything, then write bucket by bucket; see ``greenroom.optim.checkpoint.state_dict``."""
        from greenroom.optim.checkpoint.state_dict import import_state_dict

        self._hooked_load_state_dict(state_dict, import_state_dict)

    # -- what a checkpoint reads (optim.checkpoint.StreamedState) -----------------------
    def keyed_params(self) -> dict[str, torch.Tensor]:
        ours = {id(p) for p in self.streamed + self.resident}
        return {key: p for key, p in self._keyed().items() if id(p) in ours}

    def resident_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {key: self.state[p] for key, p in self._keyed().items() if p in self.state}

    def load_resident_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        params = self._keyed()
        self.state.clear()
        for key, saved in state.items():
            p = params[key]
            ours = self.param_state(p)
            ours["step"].copy_(saved["step"])
            if "exp_avg" in saved:
                device = local_tensor(p).device
                ours["exp_avg"] = saved["exp_avg"].to(device)
                ours["exp_avg_sq"] = saved["exp_avg_sq"].to(device)

    def hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        self._refuse_if_failed("step()")
        self._refuse_changed_groups()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.state and self._is_state_probe():
            self._create_state()
            return loss
        self._refuse_frozen_grads()
        self._streamed_step(self._step_resident)
        return loss

    def _is_state_probe(self) -> bool:
        """Whether this step, before any state exists, is the probe of
        ``torch.distributed.checkpoint.state_dict._init_optim_state``: every lr 0 and
        every grad zero. Taken by AdamW it changes nothing but the step counters (to 1);
        here it creates the state with the counters at 0 and no I/O, so a template
        state dict exists for DCP to load into. Checks only grads already on the device."""
        if any(float(g["lr"]) != 0.0 for g in self.param_groups):
            return False
        grads = [p.grad for p in self.streamed + self.resident + self.empty if p.grad is not None]
        return bool(grads) and not any(bool(local_tensor(g).any()) for g in grads)

    def _create_state(self) -> None:
        resident = {id(p) for p in self.resident}
        for p in self.streamed + self.resident + self.empty:
            state = self.param_state(p)
            if id(p) in resident and "exp_avg" not in state:
                local = local_tensor(p)
                state["exp_avg"] = torch.zeros_like(local, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)

    def _refuse_frozen_grads(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is not None and id(p) in self.frozen:
                    raise GreenroomError(
                        f"StreamingAdam: param {gi}.{pi} has a grad but had requires_grad=False when it was "
                        "added, so it has no optimizer state: to unfreeze it later, build the optimizer with it "
                        "trainable (a param whose grad is None is not stepped, as in AdamW)"
                    )

    def param_state(self, p: torch.Tensor) -> dict:
        """``p``'s state dict, made with its step counter the first time it is asked for
        (the state-dict code reads and fills it through this)."""
        state = self.state[p]
        if not state:
            state["step"] = new_step(local_tensor(p).device, fused=self.fused)
        return state

    def _step_resident(self) -> None:
        for p in self.empty:
            if p.grad is not None:
                self.param_state(p)["step"] += 1  # what AdamW's update of an empty tensor leaves
        for group in self.param_groups:
            params, grads, avgs, sqs, steps = [], [], [], [], []
            members = {id(p) for p in group["params"]}
            for p in self.resident:
                if id(p) not in members or p.grad is None:
                    continue
                state = self.param_state(p)
                local = local_tensor(p)
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(local, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(local, memory_format=torch.preserve_format)
                params.append(local)
                grads.append(local_tensor(p.grad))
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            bucket_adam_step(params, grads, avgs, sqs, steps, group=group, fused=self.fused, foreach=self.foreach)

    def _step_bucket(self, bucket_state) -> None:
        bucket = bucket_state.bucket
        entries = self.store.entries
        group = self.param_groups[entries[bucket.entries[0]].group]
        masters = bucket_state.views(bucket_state.master) if bucket.master is not None else None
        grad_views = bucket_state.views(self._grads_for(bucket.numel)) if masters is not None else None
        avgs = bucket_state.views(bucket_state.exp_avg)
        sqs = bucket_state.views(bucket_state.exp_avg_sq)
        todo = []  # (list position, param) of the params with a grad
        lists = ([], [], [], [], [])
        for k, i in enumerate(bucket.entries):
            p = self.streamed[i]
            if p.grad is None:
                continue
            grad = local_tensor(p.grad)
            if masters is None:
                target = local_tensor(p)
            else:
                target = masters[k]
                if not bucket.remainder:  # a remainder's decode has followed the params already
                    follow_param(target, local_tensor(p))
                grad = grad_views[k].copy_(grad)  # fp32 grads for the fp32 master, on the device
            todo.append((k, p))
            for lst, t in zip(lists, (target, grad, avgs[k], sqs[k], self.param_state(p)["step"])):
                lst.append(t)
        bucket_adam_step(*lists, group=group, fused=self.fused, foreach=self.foreach)
        if masters is not None:
            for k, p in todo:
                local_tensor(p).copy_(masters[k])  # the new master, cast to the param's dtype
