"""``greenroom plan``: the resolved plan for a set of flags, before anything runs.

Prints the per-rank dirs, the host memory per rank (pinned staging, and the streaming's
host cache), the disk each rank needs and whether the disk dir's filesystem has room, so
a user sizes a run without starting it. Exit 2 on a rule violation or when the free space cannot hold the state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from greenroom import fs
from greenroom.compression import expected_ratio
from greenroom.config import GB, OffloadConfig, add_arguments, moment_bytes_per_element, streamed_bytes_per_param
from greenroom.errors import ConfigError
from greenroom.rankdir import rank_dir_path

# The paused actor's own bytes per parameter: bf16 weights plus bf16 gradients. The
# optimizer state is added on top when it is resident (not streamed).
ACTOR_BYTES_PER_PARAM = 4.0
RESIDENT_OPTIMIZER_BYTES_PER_PARAM = 12.0




def build_plan(config: OffloadConfig, *, world_size: int, params: int, nproc_per_node: int,
               role: str, job: str) -> dict:
    """The plan as a dict (what ``--json`` prints)."""
    shard = params / world_size  # data parallelism divides the optimizer state
    stream_per_rank = shard * streamed_bytes_per_param(config.stream_optimizer_state_moment_dtype) \
        if config.stream_optimizer_state_to_disk else 0.0
    offload_per_rank = 0.0
    if config.offload_to_disk:
        offload_per_rank = params * ACTOR_BYTES_PER_PARAM
        if not config.stream_optimizer_state_to_disk:
            offload_per_rank += shard * RESIDENT_OPTIMIZER_BYTES_PER_PARAM
    per_rank = stream_per_rank + offload_per_rank
    codec = _planned_codec(config.offload_train_disk_compression)
    moments = config.stream_optimizer_state_moment_dtype
    stored_stream = 0.0
    if config.stream_optimizer_state_to_disk:
        each = shard * moment_bytes_per_element(moments)
        stored_stream = (shard * 4 / expected_ratio(codec, "fp32 master")
                         + each / expected_ratio(codec, f"{moments} exp_avg")
                         + each / expected_ratio(codec, f"{moments} exp_avg_sq"))
    stored_offload = 0.0
    if config.offload_to_disk:
        stored_offload = params * ACTOR_BYTES_PER_PARAM / expected_ratio(codec, "bf16 weights")
        if not config.stream_optimizer_state_to_disk:
            stored_offload += shard * (4 / expected_ratio(codec, "fp32 master") + 4 / expected_ratio(codec, "fp32 exp_avg")
                                       + 4 / expected_ratio(codec, "fp32 exp_avg_sq"))
    # Whole buckets only, so up to this much; the bucket files stay preallocated on disk.
    host_cache = int(min(config.host_cache_bytes, stream_per_rank))
    plan = {
        "offload": config.offload_train_target if config.offload_train else "off",
        "streaming": config.stream_optimizer_state_to_disk,
        "moment_dtype": config.stream_optimizer_state_moment_dtype,
        "world_size": world_size, "nproc_per_node": nproc_per_node, "params": params,
        "staging_bytes_per_rank": config.staging_bytes_per_rank,
        "host_cache_bytes_per_rank": host_cache,
        "host_bytes_per_rank": config.staging_bytes_per_rank + host_cache,
        "host_bytes_per_node": (config.staging_bytes_per_rank + host_cache) * nproc_per_node,
        "chunk_bytes": config.chunk_bytes,
        "disk_bytes_per_rank": {"streaming": int(stream_per_rank), "offload": int(offload_per_rank),
                                "total": int(per_rank)},
        "disk_bytes_per_node": int(per_rank * nproc_per_node),
        # Files stay preallocated at the raw size (so "fits" counts raw bytes); what
        # each sleep or step moves is expected to be this (greenroom.compression).
        "compression": codec or "none",
        "stored_bytes_per_rank": {"streaming": int(stored_stream), "offload": int(stored_offload),
                                  "total": int(stored_stream + stored_offload)},
    }
    if config.stream_optimizer_state_to_disk:
        from greenroom.optim.muon import muon_bytes_per_param  # each optimizer counts its own state

        # Per 16-bit param (fp32 master on disk); the disk figures above are StreamingAdam's.
        plan["streamed_bytes_per_param"] = {"adam": streamed_bytes_per_param(moments),
                                            "muon": muon_bytes_per_param(moments)}
    if config.uses_disk:
        root = config.offload_train_disk_dir
        mount = fs.mount_of(root)
        free = fs.free_bytes(root)
        plan.update({
            "disk_dir": root, "disk_dir_exists": os.path.isdir(root), "filesystem": mount.fstype, "mount_point": mount.mount_point,
            "free_bytes": free,
            "rank_dirs": [rank_dir_path(root, job, role, r) for r in range(min(world_size, nproc_per_node))],
            "fits": free >= per_rank * nproc_per_node,
        })
    return plan


def _planned_codec(choice: str) -> str | None:
    """The codec the ranks will run: ``auto`` plans for nvCOMP, since training runs on
    GPU nodes (the node's header line says if it does not load there)."""
    return {"auto": "nvcomp-ans", "none": None}.get(choice, choice)


def print_plan(plan: dict) -> None:
    streaming = (f"on, moments {plan['moment_dtype']}" if plan["streaming"] else "off")
    print(f"offload:    {plan['offload']}")
    print(f"streaming:  {streaming}")
    mechanisms = int(plan["offload"] == "disk") + int(plan["streaming"])
    staging = fs.human_bytes(plan["staging_bytes_per_rank"])
    if mechanisms == 2:
        staging += f" (2 x {fs.human_bytes(plan['chunk_bytes'])} chunk: offload and streaming each stage their own)"
    print(f"pinned staging per rank: {staging}")
    if plan["host_cache_bytes_per_rank"]:
        cache = plan["host_cache_bytes_per_rank"]
        share = cache / plan["disk_bytes_per_rank"]["streaming"]
        print(f"host cache per rank: up to {cache / GB:.2f} GB ({fs.human_bytes(cache)}, {share:.0%} of the streamed "
              f"state) in pinned host memory, whole buckets only; with the staging "
              f"{fs.human_bytes(plan['host_bytes_per_rank'])} per rank, {fs.human_bytes(plan['host_bytes_per_node'])} "
              f"for the node's {plan['nproc_per_node']} rank(s)")
    if "disk_dir" not in plan:
        print("disk:       not used")
        return
    d = plan["disk_bytes_per_rank"]
    missing = "" if plan["disk_dir_exists"] else ", does not exist yet: free space is that of its nearest existing parent"
    print(f"disk dir:   {plan['disk_dir']} ({plan['filesystem']} at {plan['mount_point']}{missing})")
    print("rank dirs:  " + ", ".join(plan["rank_dirs"][:2]) + (" ..." if len(plan["rank_dirs"]) > 2 else ""))
    print(f"disk per rank: {fs.human_bytes(d['total'])} (streamed state {fs.human_bytes(d['streaming'])}, "
          f"paused actor {fs.human_bytes(d['offload'])}) for {plan['params']:,} params over {plan['world_size']} rank(s)")
    if "streamed_bytes_per_param" in plan:
        per = plan["streamed_bytes_per_param"]
        print(f"streamed state per 16-bit param: StreamingAdam {per['adam']:g} B (master + 2 moments), "
              f"StreamingMuon {per['muon']:g} B (master + momentum); the figures above are StreamingAdam's")
    stored = plan["stored_bytes_per_rank"]
    if plan["compression"] != "none" and d["total"]:
        print(f"compression: {plan['compression']}: a step or sleep is expected to move "
              f"{fs.human_bytes(stored['total'])} per rank instead of {fs.human_bytes(d['total'])} "
              f"({d['total'] / stored['total']:.2f}x less; the files keep their full size)")
    need, free = plan["disk_bytes_per_node"], plan["free_bytes"]
    verdict = "OK" if plan["fits"] else "DOES NOT FIT"
    print(f"verdict:    {verdict}: {plan['nproc_per_node']} rank(s) on this node need {fs.human_bytes(need)}, "
          f"{fs.human_bytes(free)} free")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--world-size", type=int, default=1, help="number of ranks (data-parallel shards)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks sharing this node's disk (default: --world-size)")
    parser.add_argument("--params", type=float, default=0, help="model parameters, e.g. 7e9")
    parser.add_argument("--role", default="actor", help="model role: actor, critic, ...")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--world-size", args.world_size), ("--nproc-per-node", args.nproc_per_node or 1)):
        if value <= 0:
            raise ConfigError(f"{flag} must be a positive integer, got {value}")
    if args.params < 0:
        raise ConfigError(f"--params must be >= 0, got {args.params:g}")
    config = OffloadConfig.from_args(args)
    plan = build_plan(config, world_size=args.world_size, params=int(args.params),
                      nproc_per_node=args.nproc_per_node or args.world_size, role=args.role,
                      job=os.environ.get("GREENROOM_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "<job>")
    if args.json:
        print(json.dumps(plan, sort_keys=True))
    else:
        print_plan(plan)
    if plan.get("fits") is False:
        print(f"greenroom plan: error: {plan['disk_dir']} has {fs.human_bytes(plan['free_bytes'])} free, "
              f"the state needs {fs.human_bytes(plan['disk_bytes_per_node'])}: use a larger disk, more ranks, "
              "or narrower moments", file=sys.stderr)
        return 2
    return 0
