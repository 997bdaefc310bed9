"""``greenroom plan``: the run's budget for a set of flags, before anything runs.

Per rank and per node: weights, grads, optimizer state (raw, and the bytes expected on
disk under the codec), pinned staging, host cache, the paused actor's copy, disk bytes;
whether the model state fits the GPU with and without streaming; the HBM a colocated
rollout engine gets while the actor sleeps; whether a node's host memory (given) holds all
its ranks' staging, caches and (cpu target) pinned copies; whether the disk dir has room;
and, given the disk's GB/s (``greenroom bench disk``/``doctor``, or
``--measure-disk``), the expected streamed-step and sleep/wake seconds. The arithmetic is
``greenroom.cli.budget``. Exit 2 when the plan does not fit.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from dataclasses import replace

from greenroom.cli.budget import SHARDINGS, Layout, asleep_device_bytes, rank_budget, seconds
from greenroom.config import FLAG_FIELDS, OffloadConfig, OffloadFlags, add_arguments, default_disk_dir
from greenroom.dirs.rankdir import rank_dir_path
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.io.codec_names import MIN_COMPRESSED_CHUNK_MB
from greenroom.optim.footprint import PARAM_DTYPES, muon_bytes_per_param, streamed_bytes_per_param
from greenroom.units import GB, MIB, gbps, gigabytes, gigabytes_or_zero, parse_count, positive_int, size_text


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
        None if disk_gbps is None else {"read": disk_gbps[0], "write": disk_gbps[1], "source": disk_source}
    )
    plan["seconds"] = seconds(
        rank,
        nproc_per_node=n,
        read_gbps=disk_gbps and disk_gbps[0],
        write_gbps=disk_gbps and disk_gbps[1],
        offload_to_disk=config.offload_to_disk,
        streaming=config.stream_optimizer_state_to_disk,
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
            f"a node's {plan['nproc_per_node']} rank(s) need {_gb(plan['host_bytes_per_node'])} of host "
            f"memory, the node has {_gb(plan['host_memory_per_node'])} (--host-memory-gb): use a smaller "
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
            return f"use {name} ({what}): {_gb(alternatives[name]['gpu'][way])} per rank"
    streaming = alternatives.get("--stream-optimizer-state-to-disk")
    if streaming is not None and streaming["gpu"]["with_streaming"] <= gpu:
        return (
            "add --stream-optimizer-state-to-disk"
            + (" (with --offload-train-target disk)" if plan["offload"] == "cpu" else "")
            + f": {_gb(streaming['gpu']['with_streaming'])} per rank"
        )
    if way == "without_streaming":
        for name in ("--sharding optimizer", "--sharding full"):
            if name in alternatives and alternatives[name]["gpu"]["with_streaming"] <= gpu:
                return (
                    f"use {name} and add --stream-optimizer-state-to-disk: "
                    f"{_gb(alternatives[name]['gpu']['with_streaming'])} per rank"
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
    if config.chunk_bytes < MIN_COMPRESSED_CHUNK_MB * MIB:
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


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"


def print_plan(plan: dict) -> None:
    r = plan["per_rank"]
    streaming = f"on, moments {plan['moment_dtype']}, masters {plan['master_layout']}" if plan["streaming"] else "off"
    print(f"offload:    {plan['offload']}")
    print(f"streaming:  {streaming}")
    print(f"codec:      {plan['compression_line'].removeprefix('compression: ')}")
    print(
        f"layout:     {plan['params']:,} {plan['param_dtype']} params on {plan['world_size']} rank(s), "
        f"{plan['nodes']} node(s) of {plan['nproc_per_node']}: data parallel {plan['data_parallel']} x model "
        f"parallel {plan['model_parallel']}, sharding {plan['sharding']}"
    )
    state_words = (
        f"{plan['optimizer_bytes_per_param']:.3f} B/param streamed"
        if plan["streaming"]
        else f"{plan['optimizer_bytes_per_param']:g} B/param resident"
    )
    print(
        f"per rank:   weights {_gb(r['weights'])}, grads {_gb(r['grads'])}, optimizer state "
        f"{_gb(r['optimizer_state'])} ({r['optimizer_params']:,} params, {state_words})"
        + (
            f", {_gb(r['optimizer_state_stored'])} expected stored under {plan['compression']}"
            if plan["compression"] != "none"
            else ""
        )
    )
    gpu = r["gpu"]
    fits = plan["fits_gpu"] or {}
    verdict = {True: "fits", False: "DOES NOT FIT", None: "not judged: no --gpu-memory-gb"}
    print(
        f"GPU:        without streaming {_gb(gpu['without_streaming'])} "
        f"({verdict[fits.get('without_streaming')]}), with streaming {_gb(gpu['with_streaming'])} "
        f"({verdict[fits.get('with_streaming')]})"
        + (f" of {_gb(plan['gpu_memory'])}" if plan["gpu_memory"] else "")
        + " (model state only)"
    )
    print("rollout:    " + _rollout_words(plan))
    chunk = f"--offload-train-disk-chunk-mb {plan['chunk_bytes'] >> 20}"
    staging = size_text(plan["staging_bytes_per_rank"])
    if plan["staging_bytes_per_rank"] == 2 * plan["chunk_bytes"]:
        staging += f" (2 x {chunk}: offload and streaming each stage their own)"
    elif plan["staging_bytes_per_rank"]:
        staging += f" (one {chunk} buffer)"
    print(f"pinned staging per rank: {staging}")
    if plan["host_cache_bytes_per_rank"]:
        cache = plan["host_cache_bytes_per_rank"]
        share = cache / plan["disk_bytes_per_rank"]["streaming"]
        print(
            f"host cache per rank: up to {cache / GB:.2f} GB ({share:.0%} of the streamed state) in pinned host "
            "memory, whole buckets only"
        )
    if r["host"]["pinned_actor_copy"]:
        print(f"pinned actor copy per rank: {_gb(r['host']['pinned_actor_copy'])} (cpu target)")
    judged = (
        "not judged: no --host-memory-gb"
        if plan["fits_host"] is None
        else f"of {_gb(plan['host_memory_per_node'])}: " + ("fits" if plan["fits_host"] else "DOES NOT FIT")
    )
    print(
        f"host memory: {size_text(plan['host_bytes_per_rank'])} per rank, "
        f"{size_text(plan['host_bytes_per_node'])} for the node's {plan['nproc_per_node']} rank(s) ({judged})"
    )
    s = plan["seconds"]
    if s:
        d = plan["disk_gbps"]
        parts = ([f"streamed step {s['streamed_step']:.1f} s"] if "streamed_step" in s else []) + (
            [f"sleep {s['sleep']:.1f} s, wake {s['wake']:.1f} s"] if "sleep" in s else []
        )
        print(
            f"time:       disk {d['read']:g}/{d['write']:g} GB/s read/write per node ({d['source']}): "
            + (", ".join(parts) or "nothing of this plan moves through the disk")
        )
    d = plan["disk_bytes_per_rank"]
    if not d["total"]:
        print("disk:       not used")
        return
    print(
        f"disk per rank: {size_text(d['total'])} (streamed state {size_text(d['streaming'])}, paused actor "
        f"{size_text(d['offload'])}); per node {size_text(plan['disk_bytes_per_node'])} for "
        f"{plan['nproc_per_node']} rank(s)"
    )
    if "streamed_bytes_per_param" in plan:
        per = plan["streamed_bytes_per_param"]
        remainder = (
            f"; with this plan's masters as remainders StreamingAdam stores a bf16 param in "
            f"{per['adam_bf16_remainder']:.3f} B"
            if "adam_bf16_remainder" in per
            else ""
        )
        print(
            f"streamed state per 16-bit param with masters whole: StreamingAdam {per['adam']:g} B (master + 2 "
            f"moments), StreamingMuon {per['muon']:g} B (master + momentum){remainder}"
        )
    stored = plan["stored_bytes_per_rank"]
    if plan["compression"] != "none" and stored["total"]:
        print(
            f"compression: {plan['compression']}: a step or sleep is expected to move "
            f"{size_text(stored['total'])} per rank instead of {size_text(d['total'])} "
            f"({d['total'] / stored['total']:.2f}x less; the files keep their full size)"
        )
    if "disk_dir" not in plan:
        print(
            f"verdict:    {'OK' if not plan['problems'] else 'DOES NOT FIT'}: no --offload-train-disk-dir "
            f"(nor $SCRATCH): the node needs {size_text(plan['disk_bytes_per_node'])} on disk, free space not "
            "checked"
        )
        return
    missing = (
        "" if plan["disk_dir_exists"] else ", does not exist yet: free space is that of its nearest existing parent"
    )
    print(f"disk dir:   {plan['disk_dir']} ({plan['filesystem']} at {plan['mount_point']}{missing})")
    print("rank dirs:  " + ", ".join(plan["rank_dirs"][:2]) + (" ..." if len(plan["rank_dirs"]) > 2 else ""))
    # The plan's verdict, not the disk's alone: a node's host memory or a GPU that does not
    # fit fails it too (plan exits 2 on any problem).
    verdict = "OK" if not plan["problems"] else "DOES NOT FIT"
    print(
        f"verdict:    {verdict}: {plan['nproc_per_node']} rank(s) on this node need "
        f"{size_text(plan['disk_bytes_per_node'])} on disk, {size_text(plan['free_bytes'])} free"
        + (" (the disk fits; the error says what does not)" if plan["problems"] and plan["fits"] else "")
    )


def _rollout_words(plan: dict) -> str:
    """What the rollout engine gets while the actor sleeps, and what stays."""
    ro = plan["rollout"]
    keeps = (
        "the actor keeps none of its model state (it offloads; a streaming optimizer gives its bucket buffers back)"
        if plan["offload"] != "off"
        else f"the actor keeps its {_gb(ro['actor_keeps'])} of model state (no --offload-train)"
    )
    stays = (
        f"{keeps}; the CUDA context {_gb(ro['cuda_context'])} and NCCL's buffers {_gb(ro['nccl'])} stay "
        "(assumed: --cuda-context-gb, --nccl-gb; activations and the allocator's cache are given back at sleep)"
    )
    if ro["free"] is None:
        return f"HBM free while the actor sleeps not judged: no --gpu-memory-gb; {stays}"
    if ro["free"] <= 0:
        return (
            f"NO HBM free while the actor sleeps: what stays takes all of the GPU's {_gb(plan['gpu_memory'])}; {stays}"
        )
    return f"{_gb(ro['free'])} of {_gb(plan['gpu_memory'])} HBM free while the actor sleeps; {stays}"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, omit=("no_load_optim",))  # a plan resumes nothing
    run_group = parser.add_argument_group("the run")
    run_group.add_argument(
        "--params", type=parse_count, required=True, metavar="N", help="model parameters: 7B, 70B, 744B, 744e9, 1000000"
    )
    run_group.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="bf16",
        help="dtype of the weights and grads (default %(default)s; 16-bit ones get fp32 masters)",
    )
    run_group.add_argument("--world-size", type=positive_int, default=1, help="number of ranks (GPUs)")
    run_group.add_argument(
        "--nproc-per-node",
        type=positive_int,
        default=None,
        help="ranks per node, sharing its host memory and disk (default: --world-size)",
    )
    run_group.add_argument(
        "--data-parallel",
        type=positive_int,
        default=None,
        help="data-parallel replicas; the model-parallel degree (TP x PP x EP) is "
        "world size / this (default: --world-size)",
    )
    run_group.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default="none",
        help="what is sharded over the data-parallel replicas: none (DDP), optimizer "
        "(ZeRO-1, Megatron's distributed optimizer), full (FSDP, ZeRO-3)",
    )
    run_group.add_argument(
        "--gpu-memory-gb",
        type=gigabytes,
        default=None,
        metavar="GB",
        help="memory of one GPU, GB; without it the GPU fit is not judged",
    )
    run_group.add_argument(
        "--host-memory-gb",
        type=gigabytes,
        default=None,
        metavar="GB",
        help="host memory of one node, GB; without it the host memory is not judged",
    )
    run_group.add_argument(
        "--cuda-context-gb",
        type=gigabytes_or_zero,
        default=DEFAULT_CUDA_CONTEXT_GB,
        metavar="GB",
        help="device memory a rank's CUDA context and kernels keep, GB (an assumption: "
        "nvidia-smi shows an idle rank's)",
    )
    run_group.add_argument(
        "--nccl-gb",
        type=gigabytes_or_zero,
        default=DEFAULT_NCCL_GB,
        metavar="GB",
        help="device memory NCCL's buffers keep per GPU, GB (an assumption: it grows with "
        "communicators, channels and NCCL_BUFFSIZE)",
    )
    run_group.add_argument(
        "--disk-read-gbps",
        type=gbps,
        default=None,
        metavar="GB/S",
        help="the node's disk read bandwidth (greenroom bench disk / doctor measure it)",
    )
    run_group.add_argument(
        "--disk-write-gbps", type=gbps, default=None, metavar="GB/S", help="the node's disk write bandwidth"
    )
    run_group.add_argument(
        "--measure-disk",
        action="store_true",
        help="measure the disk dir's bandwidth with doctor's probe instead of giving it",
    )
    run_group.add_argument("--role", default="actor", help="model role: actor, critic, ...")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _disk_figures(args: argparse.Namespace, config: OffloadFlags) -> tuple[tuple[float, float] | None, str]:
    given = (args.disk_read_gbps, args.disk_write_gbps)
    if args.measure_disk:
        if any(given):
            raise ValueError(
                "--measure-disk measures what --disk-read-gbps/--disk-write-gbps give: pass one or the other"
            )
        if not config.uses_disk or not os.path.isdir(config.offload_train_disk_dir or ""):
            raise ValueError("--measure-disk needs an existing --offload-train-disk-dir (and a mechanism that uses it)")
        from greenroom.cli.doctor import probe

        bandwidth = probe(config.offload_train_disk_dir)
        return (bandwidth.read_bytes_per_s / GB, bandwidth.write_bytes_per_s / GB), "measured"
    if (given[0] is None) != (given[1] is None):
        raise ValueError("--disk-read-gbps and --disk-write-gbps go together: give both")
    return (given if given[0] is not None else None), "given"


def _config(args: argparse.Namespace) -> OffloadFlags:
    """The flags as the ranks will use them; with no disk dir anywhere (no flag, no
    $SCRATCH) the budget is still planned, only the free-space check is left out."""
    uses_disk = args.stream_optimizer_state_to_disk or (args.offload_train and args.offload_train_target == "disk")
    if uses_disk and args.offload_train_disk_dir is None and default_disk_dir() is None:
        return OffloadFlags.from_args(args)
    return OffloadConfig.from_args(args)  # built once: its rule warnings print once


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    layout = Layout(
        params=args.params,
        world_size=args.world_size,
        nproc_per_node=args.nproc_per_node or args.world_size,
        data_parallel=args.data_parallel or args.world_size,
        sharding=args.sharding,
        param_dtype=args.param_dtype,
    )
    disk_gbps, source = _disk_figures(args, config)
    plan = build_plan(
        config,
        layout,
        role=args.role,
        job=os.environ.get("GREENROOM_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "<job>",
        gpu_memory_gb=args.gpu_memory_gb,
        host_memory_gb=args.host_memory_gb,
        disk_gbps=disk_gbps,
        disk_source=source,
        cuda_context_gb=args.cuda_context_gb,
        nccl_gb=args.nccl_gb,
    )
    if args.json:
        print(json.dumps(plan, sort_keys=True))
    else:
        print_plan(plan)
    if plan["problems"]:
        print("greenroom plan: error: " + "; ".join(plan["problems"]), file=sys.stderr)
    return 2 if plan["problems"] else 0
