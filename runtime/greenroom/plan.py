"""``greenroom plan``: the run's budget for a set of flags, before anything runs.

Per rank and per node: weights, grads, optimizer state (raw, and the bytes expected on
disk under the codec), pinned staging, host cache, the paused actor's copy, disk bytes;
whether the model state fits the GPU with and without streaming; whether a node's host
memory holds all its ranks' staging, caches and (cpu target) pinned copies; whether the
disk dir has room; and, given the disk's GB/s (``greenroom bench disk``/``doctor``, or
``--measure-disk``), the expected streamed-step and sleep/wake seconds. The arithmetic is
``greenroom.budget``. Exit 2 when the plan does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from greenroom import fs
from greenroom.budget import SHARDINGS, Layout, rank_budget, seconds
from greenroom.config import GB, OffloadConfig, OffloadFlags, add_arguments, default_disk_dir
from greenroom.optim.footprint import PARAM_DTYPES, muon_bytes_per_param, streamed_bytes_per_param
from greenroom.rankdir import rank_dir_path
from greenroom.units import gbps, gigabytes, parse_count, positive_int


def _ints(d: dict) -> dict:
    return {k: _ints(v) if isinstance(v, dict) else int(v) for k, v in d.items()}


def build_plan(config: OffloadFlags, layout: Layout, *, role: str, job: str, gpu_memory_gb: float | None = None,
               host_memory_gb: float | None = None, disk_gbps: tuple[float, float] | None = None,
               disk_source: str = "given") -> dict:
    """The plan as a dict (what ``--json`` prints)."""
    codec = _planned_codec(config.offload_train_disk_compression) if config.uses_disk else None
    rank = rank_budget(layout, config, codec)
    n = layout.nproc_per_node
    host_node = rank["host"]["total"] * n
    if host_memory_gb is None:
        host_memory, host_source = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine"
    else:
        host_memory, host_source = int(host_memory_gb * GB), "given"
    plan = {
        "offload": config.offload_train_target if config.offload_train else "off",
        "streaming": config.stream_optimizer_state_to_disk,
        "moment_dtype": config.stream_optimizer_state_moment_dtype,
        "master_layout": config.stream_optimizer_state_master_layout,
        "compression": codec or "none",
        "params": layout.params, "param_dtype": layout.param_dtype, "world_size": layout.world_size,
        "nproc_per_node": n, "nodes": layout.world_size // n, "data_parallel": layout.data_parallel,
        "model_parallel": layout.model_parallel, "sharding": layout.sharding,
        "per_rank": _ints(rank),
        "per_node": _ints({part: {k: v * n for k, v in rank[part].items()} for part in ("host", "disk", "stored")}),
        "chunk_bytes": config.chunk_bytes,
        "staging_bytes_per_rank": config.staging_bytes_per_rank,
        "host_cache_bytes_per_rank": int(rank["host"]["host_cache"]),
        "host_bytes_per_rank": int(rank["host"]["total"]),
        "host_bytes_per_node": int(host_node),
        "disk_bytes_per_rank": _ints(rank["disk"]),
        "disk_bytes_per_node": int(rank["disk"]["total"] * n),
        "stored_bytes_per_rank": _ints(rank["stored"]),
        "host_memory_per_node": host_memory, "host_memory_source": host_source,
        "fits_host": host_node <= host_memory,
        "gpu_memory": None if gpu_memory_gb is None else int(gpu_memory_gb * GB),
        "fits_gpu": None,
    }
    if gpu_memory_gb is not None:
        plan["fits_gpu"] = {way: need <= gpu_memory_gb * GB for way, need in rank["gpu"].items()}
    plan["disk_gbps"] = None if disk_gbps is None else {"read": disk_gbps[0], "write": disk_gbps[1],
                                                        "source": disk_source}
    plan["seconds"] = seconds(rank, nproc_per_node=n, read_gbps=disk_gbps and disk_gbps[0],
                              write_gbps=disk_gbps and disk_gbps[1], offload_to_disk=config.offload_to_disk,
                              streaming=config.stream_optimizer_state_to_disk)
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
        plan.update({
            "disk_dir": root, "disk_dir_exists": os.path.isdir(root), "filesystem": mount.fstype,
            "mount_point": mount.mount_point, "free_bytes": free,
            "rank_dirs": [rank_dir_path(root, job, role, r) for r in range(n)],
            # Files stay preallocated at the raw size, so "fits" counts raw bytes.
            "fits": free >= rank["disk"]["total"] * n,
        })
    plan["problems"] = problems(plan)
    return plan


def problems(plan: dict) -> list[str]:
    """One line per way the plan does not fit (empty when it does)."""
    out = []
    gb = _gb
    if plan.get("fits") is False:
        out.append(f"{plan['disk_dir']} has {gb(plan['free_bytes'])} free, the state needs "
                   f"{gb(plan['disk_bytes_per_node'])} per node: use a larger disk, more ranks, or narrower moments")
    if not plan["fits_host"]:
        out.append(f"a node's {plan['nproc_per_node']} rank(s) need {gb(plan['host_bytes_per_node'])} of host memory, "
                   f"the node has {gb(plan['host_memory_per_node'])} ({plan['host_memory_source']}): use a smaller "
                   "chunk or host cache, the disk target, or fewer ranks per node")
    fits_gpu = plan["fits_gpu"]
    if fits_gpu is not None:
        way = "with_streaming" if plan["streaming"] else "without_streaming"
        if not fits_gpu[way]:
            need = plan["per_rank"]["gpu"][way]
            if fits_gpu["with_streaming"]:
                fix = "add --stream-optimizer-state-to-disk" + (
                    " (with --offload-train-target disk)" if plan["offload"] == "cpu" else "")
            else:
                fix = "use more model parallelism" + (", or --sharding" if plan["data_parallel"] > 1 else "")
            out.append(f"the model state needs {need / GB:.1f} GB per rank {way.replace('_', ' ')}, the GPU has "
                       f"{plan['gpu_memory'] / GB:.1f} GB: {fix}")
    return out


def _planned_codec(choice: str) -> str | None:
    """The codec the ranks will run: ``auto`` plans for nvCOMP, since training runs on
    GPU nodes (the node's header line says if it does not load there)."""
    return {"auto": "nvcomp-ans", "none": None}.get(choice, choice)


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"


def print_plan(plan: dict) -> None:
    r = plan["per_rank"]
    streaming = (f"on, moments {plan['moment_dtype']}, masters {plan['master_layout']}" if plan["streaming"]
                 else "off")
    print(f"offload:    {plan['offload']}")
    print(f"streaming:  {streaming}")
    print(f"layout:     {plan['params']:,} {plan['param_dtype']} params on {plan['world_size']} rank(s), "
          f"{plan['nodes']} node(s) of {plan['nproc_per_node']}: data parallel {plan['data_parallel']} x model "
          f"parallel {plan['model_parallel']}, sharding {plan['sharding']}")
    print(f"per rank:   weights {_gb(r['weights'])}, grads {_gb(r['grads'])}, optimizer state "
          f"{_gb(r['optimizer_state'])} ({r['optimizer_params']:,} params)"
          + (f", {_gb(r['optimizer_state_stored'])} expected stored under {plan['compression']}"
             if plan["compression"] != "none" else ""))
    gpu = r["gpu"]
    fits = plan["fits_gpu"] or {}
    verdict = {True: "fits", False: "DOES NOT FIT", None: "no --gpu-memory-gb given"}
    print(f"GPU:        without streaming {_gb(gpu['without_streaming'])} "
          f"({verdict[fits.get('without_streaming')]}), with streaming {_gb(gpu['with_streaming'])} "
          f"({verdict[fits.get('with_streaming')]})" + (f" of {_gb(plan['gpu_memory'])}" if plan["gpu_memory"] else "")
          + " (model state only)")
    staging = fs.human_bytes(plan["staging_bytes_per_rank"])
    if plan["staging_bytes_per_rank"] == 2 * plan["chunk_bytes"]:
        staging += f" (2 x {fs.human_bytes(plan['chunk_bytes'])} chunk: offload and streaming each stage their own)"
    print(f"pinned staging per rank: {staging}")
    if plan["host_cache_bytes_per_rank"]:
        cache = plan["host_cache_bytes_per_rank"]
        share = cache / plan["disk_bytes_per_rank"]["streaming"]
        print(f"host cache per rank: up to {cache / GB:.2f} GB ({fs.human_bytes(cache)}, {share:.0%} of the streamed "
              "state) in pinned host memory, whole buckets only")
    if r["host"]["pinned_actor_copy"]:
        print(f"pinned actor copy per rank: {_gb(r['host']['pinned_actor_copy'])} (cpu target)")
    print(f"host memory: {_gb(plan['host_bytes_per_rank'])} per rank, "
          f"{_gb(plan['host_bytes_per_node'])} for the node's {plan['nproc_per_node']} rank(s), of "
          f"{_gb(plan['host_memory_per_node'])} ({plan['host_memory_source']}): "
          + ("fits" if plan["fits_host"] else "DOES NOT FIT"))
    s = plan["seconds"]
    if s:
        d = plan["disk_gbps"]
        parts = ([f"streamed step {s['streamed_step']:.1f} s"] if "streamed_step" in s else []) + (
            [f"sleep {s['sleep']:.1f} s, wake {s['wake']:.1f} s"] if "sleep" in s else [])
        print(f"time:       disk {d['read']:g}/{d['write']:g} GB/s read/write per node ({d['source']}): "
              + (", ".join(parts) or "nothing of this plan moves through the disk"))
    if "disk_dir" not in plan:
        print("disk:       " + ("no --offload-train-disk-dir (nor $SCRATCH): free space not checked"
                                 if plan["disk_bytes_per_rank"]["total"] else "not used"))
        return
    d = plan["disk_bytes_per_rank"]
    missing = ("" if plan["disk_dir_exists"]
               else ", does not exist yet: free space is that of its nearest existing parent")
    print(f"disk dir:   {plan['disk_dir']} ({plan['filesystem']} at {plan['mount_point']}{missing})")
    print("rank dirs:  " + ", ".join(plan["rank_dirs"][:2]) + (" ..." if len(plan["rank_dirs"]) > 2 else ""))
    print(f"disk per rank: {fs.human_bytes(d['total'])} (streamed state {fs.human_bytes(d['streaming'])}, "
          f"paused actor {fs.human_bytes(d['offload'])})")
    if "streamed_bytes_per_param" in plan:
        per = plan["streamed_bytes_per_param"]
        bound = (f" (upper bounds: with masters as remainders it stores a bf16 param in "
                 f"{per['adam_bf16_remainder']:.3f} B)" if "adam_bf16_remainder" in per else " (masters whole)")
        print(f"streamed state per 16-bit param: StreamingAdam {per['adam']:g} B (master + 2 moments), "
              f"StreamingMuon {per['muon']:g} B (master + momentum); the figures above are StreamingAdam's{bound}")
    stored = plan["stored_bytes_per_rank"]
    if plan["compression"] != "none" and stored["total"]:
        print(f"compression: {plan['compression']}: a step or sleep is expected to move "
              f"{fs.human_bytes(stored['total'])} per rank instead of {fs.human_bytes(d['total'])} "
              f"({d['total'] / stored['total']:.2f}x less; the files keep their full size)")
    # The plan's verdict, not the disk's alone: a node's host memory or a GPU that does not
    # fit fails it too (plan exits 2 on any problem).
    verdict = "OK" if not plan["problems"] else "DOES NOT FIT"
    print(f"verdict:    {verdict}: {plan['nproc_per_node']} rank(s) on this node need "
          f"{fs.human_bytes(plan['disk_bytes_per_node'])} on disk, {fs.human_bytes(plan['free_bytes'])} free"
          + (" (the disk fits; the error says what does not)" if plan["problems"] and plan["fits"] else ""))


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    run_group = parser.add_argument_group("the run")
    run_group.add_argument("--params", type=parse_count, required=True, metavar="N",
                           help="model parameters: 7B, 70B, 744B, 744e9, 1000000")
    run_group.add_argument("--param-dtype", choices=PARAM_DTYPES, default="bf16",
                           help="dtype of the weights and grads (default %(default)s; 16-bit ones get fp32 masters)")
    run_group.add_argument("--world-size", type=positive_int, default=1, help="number of ranks (GPUs)")
    run_group.add_argument("--nproc-per-node", type=positive_int, default=None,
                           help="ranks per node, sharing its host memory and disk (default: --world-size)")
    run_group.add_argument("--data-parallel", type=positive_int, default=None,
                           help="data-parallel replicas; the model-parallel degree (TP x PP x EP) is "
                                "world size / this (default: --world-size)")
    run_group.add_argument("--sharding", choices=SHARDINGS, default="none",
                           help="what is sharded over the data-parallel replicas: none (DDP), optimizer "
                                "(ZeRO-1, Megatron's distributed optimizer), full (FSDP, ZeRO-3)")
    run_group.add_argument("--gpu-memory-gb", type=gigabytes, default=None, metavar="GB",
                           help="memory of one GPU, GB; without it the GPU fit is not judged")
    run_group.add_argument("--host-memory-gb", type=gigabytes, default=None, metavar="GB",
                           help="host memory of one node, GB (default: this machine's)")
    run_group.add_argument("--disk-read-gbps", type=gbps, default=None, metavar="GB/S",
                           help="the node's disk read bandwidth (greenroom bench disk / doctor measure it)")
    run_group.add_argument("--disk-write-gbps", type=gbps, default=None, metavar="GB/S",
                           help="the node's disk write bandwidth")
    run_group.add_argument("--measure-disk", action="store_true",
                           help="measure the disk dir's bandwidth with doctor's probe instead of giving it")
    run_group.add_argument("--role", default="actor", help="model role: actor, critic, ...")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _disk_figures(args: argparse.Namespace, config: OffloadFlags) -> tuple[tuple[float, float] | None, str]:
    given = (args.disk_read_gbps, args.disk_write_gbps)
    if args.measure_disk:
        if any(given):
            raise ValueError("--measure-disk measures what --disk-read-gbps/--disk-write-gbps give: pass one or "
                             "the other")
        if not config.uses_disk or not os.path.isdir(config.offload_train_disk_dir or ""):
            raise ValueError("--measure-disk needs an existing --offload-train-disk-dir (and a mechanism that uses it)")
        from greenroom.doctor import probe

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
    layout = Layout(params=args.params, world_size=args.world_size,
                    nproc_per_node=args.nproc_per_node or args.world_size,
                    data_parallel=args.data_parallel or args.world_size, sharding=args.sharding,
                    param_dtype=args.param_dtype)
    disk_gbps, source = _disk_figures(args, config)
    plan = build_plan(config, layout, role=args.role,
                      job=os.environ.get("GREENROOM_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "<job>",
                      gpu_memory_gb=args.gpu_memory_gb, host_memory_gb=args.host_memory_gb, disk_gbps=disk_gbps,
                      disk_source=source)
    if args.json:
        print(json.dumps(plan, sort_keys=True))
    else:
        print_plan(plan)
    if plan["problems"]:
        print("greenroom plan: error: " + "; ".join(plan["problems"]), file=sys.stderr)
    return 2 if plan["problems"] else 0
