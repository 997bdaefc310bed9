"""``StreamingDistributedOptimizer``: megatron's DistributedOptimizer with streamed state.

It is megatron-core's own ``DistributedOptimizer`` class with the methods below changed,
so everything around the update (grad reduce-scatter, copying grads into main grads, loss
scaling, grad clipping, the param all-gather) is megatron's, unchanged:

``_build_model_and_main_param_groups`` (construction)
    Megatron's own builder runs on one param at a time and each new fp32 main shard goes
    straight into the bucket files, its device storage freed: the peak is the largest
    single shard (``greenroom.megatron.construction``).

``step_with_ready_grads``
    Replaces the inner ``optimizer.step()`` plus ``_copy_main_params_to_model_params``
    with the bucket engine: one bucket of mains and moments on the GPU at a time, updated
    with torch's Adam kernel under the inner optimizer's hyperparameters and
    implementation, the new mains cast into the 16-bit param buffer, the bucket written
    back. Native-fp32 params step under a small resident Adam of the same kind.

``_copy_main_params_to_model_params`` / ``_copy_model_params_to_main_params``
    The first copies only the resident fp32 shards (the streamed ones were cast into
    the param buffer in the bucket loop); the second is refused with a message.

``sharded_state_dict`` / ``load_state_dict``
    Put the streamed state into megatron's checkpoint under stock megatron-core's
    ``fully_reshardable`` or ``dp_reshardable`` keys, or carry only the small state for the sidecar format
    (``greenroom.megatron.dist_ckpt``; docs/megatron.md). ``state_dict`` is the small state.

The ``streaming()`` block megatron builds it in, and the lookup of a chain's streaming
members, are ``greenroom.megatron.block``.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from greenroom.dirs.statedir import StateDir
from greenroom.errors import CheckpointError, GreenroomError
from greenroom.megatron import checks, dist_ckpt
from greenroom.megatron.class_swap import current_settings, swapping_in_another_thread
from greenroom.megatron.construction import BUILDING, Building, build_main_param_groups
from greenroom.megatron.inner_optimizer import (
    AlreadyStepped,
    implementation,
    jsonable,
    resident_adam,
    sync_hyperparams,
)
from greenroom.megatron.layout import ShardEntry, Topology, current_topology
from greenroom.megatron.staging import DECODE_IN_SAVE
from greenroom.optim import kernel
from greenroom.optim.poison import FailedStepPoison
from greenroom.optim.store.bucket_store import BucketStore


class StreamingDistributedOptimizer(FailedStepPoison, DistributedOptimizer):
    """A DistributedOptimizer whose 16-bit params' fp32 mains and Adam moments stream.

    Built by megatron itself inside ``greenroom.megatron.streaming(...)``; see there. A
    step whose stream fails poisons it as it does ``StreamingAdam`` (``optim.poison``
    Note [a failed step poisons]): its later steps, ``state_dict()`` and
    ``greenroom.megatron.save_checkpoint`` refuse until a whole state is loaded
    (``greenroom.megatron.load_checkpoint``, or ``load_state_dict`` of a ``fully_reshardable``
    or ``dp_reshardable`` checkpoint, ``dist_ckpt``).
    """

    what = "StreamingDistributedOptimizer"
    reload_with = "greenroom.megatron.load_checkpoint, or a fully_reshardable or dp_reshardable load_state_dict"

    _state_dir: StateDir | None = None  # the dir this member claimed; released by close()
    _mcore_save = None  # the frozen maps of the last dist_checkpointing save (dist_ckpt)
    _mcore_load = None  # the load template dist_checkpointing fills (dist_ckpt)

    def __init__(self, *args, **kwargs) -> None:
        settings = current_settings()
        if settings is None:
            elsewhere = swapping_in_another_thread()
            raise GreenroomError(
                "construct StreamingDistributedOptimizer through greenroom.megatron.streaming()"
                + (
                    ": another thread is inside a streaming() block, and until it ends megatron builds this class "
                    "in every thread; build a process's megatron optimizers from one thread"
                    if elsewhere
                    else ""
                )
            )
        # By name, through megatron's own signature: its positional order has changed
        # between releases.
        given = inspect.signature(DistributedOptimizer.__init__).bind(self, *args, **kwargs).arguments
        model_chunks = given["model_chunks"]
        checks.check_optimizer_config(given["config"])
        checks.check_ddp_config(model_chunks[0].ddp_config)
        if getattr(model_chunks[0], "config", None) is not None:  # the chunk's TransformerConfig
            checks.check_transformer_config(model_chunks[0].config)
        checks.check_inner_optimizer(given["optimizer"])
        building = Building(settings=settings, model_chunks=model_chunks)
        token = BUILDING.set(building)
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            try:
                if building.store is not None:
                    building.store.close()
            finally:
                if building.state_dir is not None:
                    building.state_dir.release()
            raise
        finally:
            BUILDING.reset(token)
        self._state_dir = building.state_dir
        if self.is_stub_optimizer:
            self._store = None
            return
        self._store = building.store
        self.shard_entries: list[ShardEntry] = building.entries
        self.streamed_steps = 0
        self.settings = settings
        self.topology: Topology = current_topology(self.data_parallel_group)
        self.resident_optimizer = resident_adam(self.optimizer, self.shard_fp32_groups)

    # -- construction -------------------------------------------------------------
    @classmethod
    def _build_model_and_main_param_groups(cls, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
        building = BUILDING.get()
        if building is None:
            return super()._build_model_and_main_param_groups(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        return build_main_param_groups(
            building, super()._build_model_and_main_param_groups, gbuf_ranges, param_gbuf_map, opt_group_ranges, config
        )

    # -- the step -----------------------------------------------------------------
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if self.is_stub_optimizer:
            return super().step_with_ready_grads()
        # The inner optimizer's step and the copy of the mains into the param buffer
        # happen inside the bucket loop; what follows them (the param all-gather) is
        # megatron's own.
        self._refuse_if_failed("step()")
        checks.check_step_decay(self.optimizer)
        inner, self.optimizer = self.optimizer, AlreadyStepped(self.optimizer)
        try:
            with self._poisoned_if_it_fails():
                try:
                    self._stream_step(inner)
                finally:
                    # Only now: while a save's frozen names link the live inodes, this
                    # step writes every bucket to a new inode (optim.store.files Note [new
                    # inodes]), so an async save's writer, still reading its maps, reads
                    # the state it was scheduled with; released first, the step would write
                    # the mapped inodes in place under it.
                    dist_ckpt.release(self)
            return super().step_with_ready_grads()
        finally:
            self.optimizer = inner

    def _stream_step(self, inner) -> None:
        sync_hyperparams(inner, self.resident_optimizer)
        if self.resident_optimizer is not None:
            self.resident_optimizer.step()
        mains = [main for group in self.shard_fp32_from_float16_groups for main in group]
        fused, foreach = implementation(inner, mains)
        count = self.streamed_steps
        for state in self._store.stream():
            members = state.bucket.entries
            group = inner.param_groups[self.shard_entries[members[0]].group]
            grads = [self.main_shard(i).grad for i in members]
            # Each streamed shard has had the same number of steps (megatron gives every
            # main a grad each step); torch counts per param, so one counter each.
            steps = [kernel.new_step(state.master.device, fused=fused) + count for _ in members]
            masters = state.views(state.master)
            kernel.bucket_adam_step(
                masters,
                grads,
                state.views(state.exp_avg),
                state.views(state.exp_avg_sq),
                steps,
                group=group,
                fused=fused,
                foreach=foreach,
            )
            for i, master in zip(members, masters):
                entry = self.shard_entries[i]
                self._model_shard_for(entry.group, entry.index).copy_(master)
        self.streamed_steps = count + 1

    def initialize_state(self) -> None:
        """A fresh optimizer state: fp32 mains from the current 16-bit weights (bucket by
        bucket, as at construction), zero moments, no steps taken."""
        entries = self.shard_entries
        with self._poisoned_if_it_fails("initialize_state()", "partly reset (some buckets fresh, some not)"):
            self._store.initialize(lambda i: self._model_shard_for(entries[i].group, entries[i].index))
            if self.resident_optimizer is not None:
                self.resident_optimizer.state.clear()
            self.streamed_steps = 0
        self._state_replaced()

    def main_shard(self, i: int) -> torch.Tensor:
        entry = self.shard_entries[i]
        return self.shard_fp32_from_float16_groups[entry.group][entry.index]

    def streamed_state(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entry ``i``'s fp32 main, exp_avg and exp_avg_sq, decoded, on the host (for tests
        and inspection: it reads the entry's whole bucket)."""
        bucket = next(b for b in self._store.buckets if i in b.entries)
        states = self._store.stream([bucket.index])
        state = next(states)
        k = bucket.entries.index(i)
        entry_state = tuple(
            state.views(t)[k].detach().cpu().clone() for t in (state.master, state.exp_avg, state.exp_avg_sq)
        )
        states.close()  # nothing changed: closing before the write-back skips it
        return entry_state

    def _model_shard_for(self, group: int, index: int) -> torch.Tensor:
        """The slice of the 16-bit param buffer that main shard (group, index) feeds."""
        return self._param_buffer_slice(self.model_float16_groups[group][index])

    def _param_buffer_slice(self, model_param) -> torch.Tensor:
        # Where megatron's own copy writes: the param's range in its DDP bucket's buffer,
        # which the all-gather then sends.
        world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
        gbuf_index, _, bucket_id = self.model_param_gbuf_map[model_param]
        return self.buffers[gbuf_index].buckets[bucket_id].param_data.view(-1)[world.start : world.end]

    def _copy_main_params_to_model_params(self) -> None:
        # Streamed mains were cast into the param buffer bucket by bucket; only the
        # resident fp32 shards remain, and they alias the model params.
        for shards, params in zip(self.shard_fp32_groups, self.model_fp32_groups):
            for shard, model_param in zip(shards, params):
                self._param_buffer_slice(model_param).copy_(shard)

    def _copy_model_params_to_main_params(self, state_dict=None) -> None:
        raise CheckpointError(
            "the streamed DistributedOptimizer cannot re-initialise its fp32 mains from the "
            "model weights (reload_model_params): load the optimizer with "
            "greenroom.megatron.load_checkpoint, or build it again"
        )

    # -- checkpoints (the non-streamed parts) ---------------------------------------
    def state_dict(self):
        self._refuse_if_failed("state_dict()")
        return self._small_state()

    def _small_state(self) -> dict:
        inner = self.optimizer
        groups = []
        for group in inner.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"})
        state = {
            "optimizer": {"param_groups": groups},
            "greenroom": {
                "streamed": True,
                "steps": self.streamed_steps,
                "resident": (self.resident_optimizer.state_dict() if self.resident_optimizer else None),
            },
        }
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict) -> None:
        if state_dict.get("param_state_sharding_type") in dist_ckpt.MCORE_TYPES:
            dist_ckpt.load_state_dict(self, state_dict)
            return
        marker = state_dict.get("greenroom")
        if not marker or not marker.get("streamed"):
            raise CheckpointError(
                "this optimizer checkpoint was written without greenroom streaming: its Adam state cannot "
                "be read into the streamed optimizer from a state_dict; load megatron's checkpoint through "
                "sharded_state_dict(model_sd, is_loading=True, metadata={'distrib_optim_sharding_type': "
                "'dp_reshardable'}) or 'fully_reshardable' (the type it was saved with), resume with no_load_optim "
                "(fresh optimizer state), "
                "or turn --stream-optimizer-state-to-disk off"
            )
        for group, saved in zip(self.optimizer.param_groups, state_dict["optimizer"]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.resident_optimizer is not None and marker.get("resident") is not None:
            self.resident_optimizer.load_state_dict(marker["resident"])
        if self.grad_scaler and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    def sharded_state_dict(
        self, model_sharded_state_dict=None, is_loading: bool = False, sharding_type=None, metadata=None
    ):
        if not is_loading:  # a load's template is how the poison is cured: never refused
            self._refuse_if_failed("sharded_state_dict()")
        chosen = dist_ckpt.resolve_sharding_type(sharding_type, metadata)
        if chosen == dist_ckpt.SIDECAR_SHARDING_TYPE:
            return dist_ckpt.sidecar_state(self)
        decode_in_save = bool((metadata or {}).get(DECODE_IN_SAVE))
        return dist_ckpt.sharded_state_dict(self, model_sharded_state_dict, is_loading, chosen, decode_in_save)

    # -- the streamed state's checkpoint (greenroom.optim.checkpoint.manifest.StreamedState) --
    # Keys: "main.<group>.<index>" for the streamed fp32 mains of 16-bit params,
    # "fp32.<group>.<index>" for the native-fp32 shards under the resident Adam.
    @property
    def store(self) -> BucketStore:
        assert self._store is not None, "a stub optimizer (no params on this rank) streams nothing"
        return self._store

    def _keyed_mains(self) -> dict[str, torch.Tensor]:
        return {f"main.{e.group}.{e.index}": self.main_shard(i) for i, e in enumerate(self.shard_entries)}

    def _keyed_fp32(self) -> dict[str, torch.Tensor]:
        return {f"fp32.{g}.{i}": p for g, group in enumerate(self.shard_fp32_groups) for i, p in enumerate(group)}

    def keyed_params(self) -> dict[str, torch.Tensor]:
        return {**self._keyed_mains(), **self._keyed_fp32()}

    def resident_params(self) -> dict[str, torch.Tensor]:
        return self.keyed_params()

    def resident_state(self) -> dict[str, dict[str, torch.Tensor]]:
        # Every streamed shard has taken the same steps (megatron gives every main a
        # grad each step): one counter, recorded per shard as torch records it.
        state = {key: {"step": torch.tensor(float(self.streamed_steps))} for key in self._keyed_mains()}
        resident = self.resident_optimizer
        for key, p in self._keyed_fp32().items():
            if resident is not None and resident.state.get(p):
                state[key] = dict(resident.state[p])
        return state

    def load_resident_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        steps = {float(state[key]["step"]) for key in self._keyed_mains() if key in state}
        if len(steps) > 1:
            raise CheckpointError(
                f"the streamed shards were saved at different steps {sorted(steps)}; the "
                "checkpoint is not one a streaming DistributedOptimizer wrote"
            )
        self.streamed_steps = int(steps.pop()) if steps else 0
        if self.resident_optimizer is None:
            return
        self.resident_optimizer.state.clear()
        for key, p in self._keyed_fp32().items():
            if key in state:
                saved = state[key]
                ours = {"step": kernel.new_step(torch.device("cpu"), fused=False).copy_(saved["step"])}
                if "exp_avg" in saved:
                    ours["exp_avg"] = saved["exp_avg"].to(p.device)
                    ours["exp_avg_sq"] = saved["exp_avg_sq"].to(p.device)
                self.resident_optimizer.state[p] = ours

    def hyperparameters(self) -> list[dict]:
        # megatron's groups also carry config objects, which stay out of the manifest.
        return [
            {k: v for k, v in group.items() if k != "params" and jsonable(v)} for group in self.optimizer.param_groups
        ]

    def load_hyperparameters(self, groups: list[dict]) -> None:
        for group, saved in zip(self.optimizer.param_groups, groups):
            group.update(saved)

    # -- lifetime -----------------------------------------------------------------
    def release_device_memory(self) -> int:
        """Give back the bucket buffers between steps, as ``StreamingAdam`` does (the
        files hold what they held; the next step makes them again); returns the bytes."""
        if self._store is None:
            return 0
        freed = self._store.device_bytes()
        self._store.release_device_buffers()
        return freed

    def close(self) -> None:
        """Release the bucket files' handles and the staging memory, then this member's
        dir (removed at once when ``streaming()`` was given a plain path)."""
        try:
            dist_ckpt.release(self)
            if self._store is not None:
                self._store.close()
        finally:
            if self._state_dir is not None:
                state_dir, self._state_dir = self._state_dir, None
                state_dir.release()


__all__ = ["StreamingDistributedOptimizer", "Topology"]
