"""The plan ``greenroom plan`` prints (``greenroom.cli.plan``), as one dict: the budget per
rank and per node (``greenroom.cli.budget``'s arithmetic) under the flags, whether it fits
the GPU, the node's host memory and the disk dir, the HBM left to a rollout engine while
the actor sleeps, the expected seconds given the disk's GB/s, and, for each way it does
not fit, one line with the changes that would fit it (each one flag away, budgeted the
same way). What ``--json`` prints is this dict; ``plan_text`` writes it out.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import replace

from greenroom.cli.budget import SHARDINGS, Layout, asleep_device_bytes, rank_budget, seconds
from greenroom.config import FLAG_FIELDS, OffloadFlags
from greenroom.dirs.names import rank_dir_path
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.io.codec_names import MIN_COMPRESSED_CHUNK_MB, frames_fit
from greenroom.optim.footprint import muon_bytes_per_param, streamed_bytes_per_param
from greenroom.units import GB, size_text


def _ints(d: dict) -> dict:
    return {k: _ints(v) if isinstance(v, dict) else int(v) for k, v in d.items()}


# What stays on a GPU while the actor sleeps besides its own state, unless given: a torch
# process's CUDA context and kernels (about half a GB on an H100 with CUDA 12/13), and
# NCCL's buffers for one communicator of 8 GPUs (channels x peers x NCCL_BUFFSIZE); more
# communicators, or larger buffers, take more. Assumptions, stated as such in the output.
DEFAULT_CUDA_CONTEXT_GB = 0.5
DEFAULT_NCCL_GB = 1.0


def build_plan(
    config: OffloadFlags,
    layout: Layout,
    *,
    role: str,
    job: str,
    gpu_memory_gb: float | None = None,
    host_memory_gb: float | None = None,
    disk_gbps: tuple[float, float] | None = None,
    mixed_gbps: tuple[float, float] | None = None,
    disk_source: str = "given",
    cuda_context_gb: float = DEFAULT_CUDA_CONTEXT_GB,
    nccl_gb: float = DEFAULT_NCCL_GB,
) -> dict:
    """The plan as a dict (what ``--json`` prints)."""
    codec, codec_line = planned_codec(config)
    rank = rank_budget(layout, config, codec)
    n = layout.nproc_per_node
    host_node = rank["host"]["total"] * n
    # Host memory is judged against the nodes the run gets, given: plan runs on a login
    # node or a laptop, whose memory says nothing about them (as for the GPU).
    host_memory = None if host_memory_gb is None else int(host_memory_gb * GB)
    plan = {
        "offload": config.offload_train_target if config.offload_train else "off",
        "streaming": config.stream_optimizer_state_to_disk,
        "moment_dtype": config.stream_optimizer_state_moment_dtype,
        "master_layout": config.stream_optimizer_state_master_layout,
        "compression": codec or "none",
        "compression_line": codec_line,
        "params": layout.params,
        "param_dtype": layout.param_dtype,
        "world_size": layout.world_size,
        "nproc_per_node": n,
        "nodes": layout.world_size // n,
        "data_parallel": layout.data_parallel,
        "model_parallel": layout.model_parallel,
        "sharding": layout.sharding,
        "per_rank": _ints(rank),
        "per_node": _ints({part: {k: v * n for k, v in rank[part].items()} for part in ("host", "disk", "stored")}),
        "optimizer_bytes_per_param": rank["optimizer_state"] / rank["optimizer_params"]
        if rank["optimizer_params"]
        else 0.0,
        "chunk_bytes": config.chunk_bytes,
        "staging_bytes_per_rank": config.staging_bytes_per_rank,
        "host_cache_bytes_per_rank": int(rank["host"]["host_cache"]),
        "host_bytes_per_rank": int(rank["host"]["total"]),
        "host_bytes_per_node": int(host_node),
        "disk_bytes_per_rank": _ints(rank["disk"]),
        "disk_bytes_per_node": int(rank["disk"]["total"] * n),
        "stored_bytes_per_rank": _ints(rank["stored"]),
        "host_memory_per_node": host_memory,
        "host_memory_source": "given" if host_memory is not None else None,
        "fits_host": None if host_memory is None else host_node <= host_memory,
        "gpu_memory": None if gpu_memory_gb is None else int(gpu_memory_gb * GB),
        "fits_gpu": None,
    }
    if gpu_memory_gb is not None:
        plan["fits_gpu"] = {way: need <= gpu_memory_gb * GB for way, need in rank["gpu"].items()}
    plan["rollout"] = _rollout(rank, config, plan["gpu_memory"], cuda_context_gb, nccl_gb)
    plan["disk_gbps"] = (
        None
        if disk_gbps is None
        else {
            "read": disk_gbps[0],
            "write": disk_gbps[1],
            # Reads and writes at once (a streamed step's), probed at the node's concurrency:
            # measured only (budget Note [node probe]).
            "mixed_read": mixed_gbps and mixed_gbps[0],
            "mixed_write": mixed_gbps and mixed_gbps[1],
            "source": disk_source,
        }
    )
    plan["seconds"] = seconds(
        rank,
        nproc_per_node=n,
        read_gbps=disk_gbps and disk_gbps[0],
        write_gbps=disk_gbps and disk_gbps[1],
        offload_to_disk=config.offload_to_disk,
        streaming=config.stream_optimizer_state_to_disk,
        mixed_gbps=mixed_gbps,
    )
    if config.stream_optimizer_state_to_disk:
        moments = config.stream_optimizer_state_moment_dtype
        # Per 16-bit param (fp32 master on disk); the figures above are StreamingAdam's.
        per = {"adam": streamed_bytes_per_param(moments), "muon": muon_bytes_per_param(moments)}
        if config.stream_optimizer_state_master_layout == "remainder":
            # What StreamingAdam stores for a bf16 param by default; --stream-optimizer-state-master-layout
            # fp32 stores the whole master ("adam").
            per["adam_bf16_remainder"] = streamed_bytes_per_param(moments, remainder=True)
        plan["streamed_bytes_per_param"] = per
    if config.uses_disk and config.offload_train_disk_dir is not None:
        root = config.offload_train_disk_dir
        mount = fs.mount_of(root)
        free = fs.free_bytes(root)
        plan.update(
            {
                "disk_dir": root,
                "disk_dir_exists": os.path.isdir(root),
                "filesystem": mount.fstype,
                "mount_point": mount.mount_point,
                "free_bytes": free,
                "rank_dirs": [rank_dir_path(root, job, role, r) for r in range(n)],
                # Files stay preallocated at the raw size, so "fits" counts raw bytes.
                "fits": free >= rank["disk"]["total"] * n,
            }
        )
    plan["problems"] = problems(plan, _alternatives(plan, config, layout, codec))
    return plan


def _rollout(rank: dict, config: OffloadFlags, gpu_memory: int | None, cuda_context_gb: float, nccl_gb: float) -> dict:
    """The HBM a colocated rollout engine gets while the actor sleeps: the GPU less what
    stays (the CUDA context, NCCL's buffers, what the actor keeps)."""
    keeps = asleep_device_bytes(rank, config)
    context, nccl = cuda_context_gb * GB, nccl_gb * GB
    return {
        "actor_keeps": int(keeps),
        "cuda_context": int(context),
        "nccl": int(nccl),
        "free": None if gpu_memory is None else int(gpu_memory - keeps - context - nccl),
    }


def _alternatives(plan: dict, config: OffloadFlags, layout: Layout, codec: str | None) -> dict:
    """The budgets of the changes plan may advise, each one flag away from this plan:
    sharding the optimizer state or everything over the data-parallel replicas,
    streaming, narrower moments, masters as remainders, the cpu target."""
    flags = {name: getattr(config, name) for name in FLAG_FIELDS}
    # The resolved target counts as given when rebuilt: keep it unsaid where it was.
    flags["offload_train_target"] = config.offload_train_target if config._target_given else None
    out = {}

    def variant(name: str, layout_changes: dict | None = None, **flag_changes) -> None:
        try:
            # A variant is a what-if: the rule warnings of the user's own flags printed once.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                other = OffloadFlags(**{**flags, **flag_changes})
        except ConfigError:
            return
        out[name] = rank_budget(replace(layout, **(layout_changes or {})), other, codec)

    if layout.data_parallel > 1:
        for sharding in SHARDINGS[SHARDINGS.index(layout.sharding) + 1 :]:
            variant(f"--sharding {sharding}", {"sharding": sharding})
    if not config.stream_optimizer_state_to_disk:
        variant(
            "--stream-optimizer-state-to-disk",
            stream_optimizer_state_to_disk=True,
            offload_train_target="disk" if config.offload_train else flags["offload_train_target"],
        )
    else:
        if config.stream_optimizer_state_moment_dtype == "fp32":
            variant("--stream-optimizer-state-moment-dtype bf16", stream_optimizer_state_moment_dtype="bf16")
        if config.stream_optimizer_state_master_layout == "fp32" and layout.param_dtype == "bf16":
            variant(
                "--stream-optimizer-state-master-layout remainder", stream_optimizer_state_master_layout="remainder"
            )
    if config.offload_to_disk and not config.stream_optimizer_state_to_disk:
        variant("--offload-train-target cpu", offload_train_target="cpu")
    return out


def problems(plan: dict, alternatives: dict | None = None) -> list[str]:
    """One line per way the plan does not fit (empty when it does), each with the changes
    that would fit it, by what they leave."""
    alternatives = alternatives or {}
    out = []
    if plan.get("fits") is False:
        out.append(_disk_problem(plan, alternatives))
    if plan["fits_host"] is False:
        out.append(
            f"a node's {plan['nproc_per_node']} rank(s) need {gb_text(plan['host_bytes_per_node'])} of host "
            f"memory, the node has {gb_text(plan['host_memory_per_node'])} (--host-memory-gb): use a smaller "
            "chunk or host cache, the disk target, or fewer ranks per node"
        )
    fits_gpu = plan["fits_gpu"]
    if fits_gpu is not None:
        way = "with_streaming" if plan["streaming"] else "without_streaming"
        if not fits_gpu[way]:
            need = plan["per_rank"]["gpu"][way]
            out.append(
                f"the model state needs {need / GB:.1f} GB per rank {way.replace('_', ' ')}, the GPU has "
                f"{plan['gpu_memory'] / GB:.1f} GB: {_gpu_fix(plan, alternatives, way)}"
            )
    return out


def _gpu_fix(plan: dict, alternatives: dict, way: str) -> str:
    """The first change that fits the GPU, in the order that costs least at run time:
    sharding over the data-parallel replicas (no disk traffic), then streaming."""
    gpu = plan["gpu_memory"]
    for name in ("--sharding optimizer", "--sharding full"):
        if name in alternatives and alternatives[name]["gpu"][way] <= gpu:
            what = "ZeRO-1, Megatron's distributed optimizer" if name.endswith("optimizer") else "FSDP, ZeRO-3"
            return f"use {name} ({what}): {gb_text(alternatives[name]['gpu'][way])} per rank"
    streaming = alternatives.get("--stream-optimizer-state-to-disk")
    if streaming is not None and streaming["gpu"]["with_streaming"] <= gpu:
        return (
            "add --stream-optimizer-state-to-disk"
            + (" (with --offload-train-target disk)" if plan["offload"] == "cpu" else "")
            + f": {gb_text(streaming['gpu']['with_streaming'])} per rank"
        )
    if way == "without_streaming":
        for name in ("--sharding optimizer", "--sharding full"):
            if name in alternatives and alternatives[name]["gpu"]["with_streaming"] <= gpu:
                return (
                    f"use {name} and add --stream-optimizer-state-to-disk: "
                    f"{gb_text(alternatives[name]['gpu']['with_streaming'])} per rank"
                )
    return "use more model parallelism (TP x PP x EP: a larger --world-size over --data-parallel)"


def _disk_problem(plan: dict, alternatives: dict) -> str:
    """The disk that does not hold a node's ranks, and what each change leaves per node."""
    n, free = plan["nproc_per_node"], plan["free_bytes"]
    fixes = [
        f"{name} ({size_text(alt['disk']['total'] * n)} per node)"
        for name, alt in alternatives.items()
        if alt["disk"]["total"] * n < plan["disk_bytes_per_node"]
    ]
    fixes.append(
        f"fewer ranks per node (each needs {size_text(plan['disk_bytes_per_rank']['total'])}; "
        "more nodes or more model parallelism)"
    )
    fixes.append("a disk dir with more free space")
    return (
        f"{plan['disk_dir']} has {size_text(free)} free, the node's {n} rank(s) need "
        f"{size_text(plan['disk_bytes_per_node'])}: " + "; or ".join(fixes)
    )


def planned_codec(config: OffloadFlags) -> tuple[str | None, str]:
    """The codec plan sizes the stored bytes with, and one line saying which and why.
    ``auto`` resolves as ``greenroom train`` resolves it, by what is installed here:
    nvcomp-ans where the nvCOMP wheel (the nvcomp extra) is, else none. An explicit codec
    is planned as given (the training nodes may have what this machine lacks)."""
    if not config.uses_disk:
        return None, "compression: not used (nothing goes to disk)"
    choice = config.offload_train_disk_compression
    if choice != "auto":
        return (None if choice == "none" else choice), f"compression: {choice} (--offload-train-disk-compression)"
    if not frames_fit(config.offload_train_disk_chunk_mb):
        return None, (
            f"compression: none (auto: --offload-train-disk-chunk-mb is under {MIN_COMPRESSED_CHUNK_MB}, "
            "too small for one-MiB frames)"
        )
    try:
        installed = importlib.util.find_spec("nvidia.nvcomp") is not None
    except ModuleNotFoundError:
        installed = False
    if installed:
        return "nvcomp-ans", "compression: nvcomp-ans (auto: the nvCOMP wheel is installed here; it runs on CUDA)"
    return None, (
        "compression: none (auto: the nvCOMP wheel is not installed here, so train would run none; "
        "--offload-train-disk-compression nvcomp-ans plans for nodes that have it)"
    )


def gb_text(nbytes: float) -> str:
    """Bytes as the plan prints them: decimal GB, one decimal."""
    return f"{nbytes / GB:.1f} GB"
