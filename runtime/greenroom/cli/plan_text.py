"""The text ``greenroom plan`` prints (``greenroom.cli.plan``) without ``--json``: the plan
``plan_build.build_plan`` returns, one line per part, and its verdict.
"""

from __future__ import annotations

from greenroom.cli.plan_build import gb_text
from greenroom.units import GB, size_text


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
        f"per rank:   weights {gb_text(r['weights'])}, grads {gb_text(r['grads'])}, optimizer state "
        f"{gb_text(r['optimizer_state'])} ({r['optimizer_params']:,} params, {state_words})"
        + (
            f", {gb_text(r['optimizer_state_stored'])} expected stored under {plan['compression']}"
            if plan["compression"] != "none"
            else ""
        )
    )
    gpu = r["gpu"]
    fits = plan["fits_gpu"] or {}
    verdict = {True: "fits", False: "DOES NOT FIT", None: "not judged: no --gpu-memory-gb"}
    print(
        f"GPU:        without streaming {gb_text(gpu['without_streaming'])} "
        f"({verdict[fits.get('without_streaming')]}), with streaming {gb_text(gpu['with_streaming'])} "
        f"({verdict[fits.get('with_streaming')]})"
        + (f" of {gb_text(plan['gpu_memory'])}" if plan["gpu_memory"] else "")
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
        print(f"pinned actor copy per rank: {gb_text(r['host']['pinned_actor_copy'])} (cpu target)")
    judged = (
        "not judged: no --host-memory-gb"
        if plan["fits_host"] is None
        else f"of {gb_text(plan['host_memory_per_node'])}: " + ("fits" if plan["fits_host"] else "DOES NOT FIT")
    )
    print(
        f"host memory: {size_text(plan['host_bytes_per_rank'])} per rank, "
        f"{size_text(plan['host_bytes_per_node'])} for the node's {plan['nproc_per_node']} rank(s) ({judged})"
    )
    s = plan["seconds"]
    if s:
        d = plan["disk_gbps"]
        overlap = "its reads and writes at once" if d["mixed_read"] else "its reads, then its writes"
        parts = ([f"streamed step {s['streamed_step']:.1f} s ({overlap})"] if "streamed_step" in s else []) + (
            [f"sleep {s['sleep']:.1f} s, wake {s['wake']:.1f} s"] if "sleep" in s else []
        )
        how = d["source"]
        if d["mixed_read"]:
            how = (
                f"{d['mixed_read']:.2f}/{d['mixed_write']:.2f} at once; {d['source']} at "
                f"{plan['nproc_per_node']} rank(s)' concurrency"
            )
        rate = "{:g}" if d["source"] == "given" else "{:.2f}"  # as given, or a probe's to 10 MB/s
        print(
            f"time:       disk {rate.format(d['read'])}/{rate.format(d['write'])} GB/s read/write per node ({how}): "
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
        else f"the actor keeps its {gb_text(ro['actor_keeps'])} of model state (no --offload-train)"
    )
    stays = (
        f"{keeps}; the CUDA context {gb_text(ro['cuda_context'])} and NCCL's buffers {gb_text(ro['nccl'])} stay "
        "(assumed: --cuda-context-gb, --nccl-gb; activations and the allocator's cache are given back at sleep)"
    )
    if ro["free"] is None:
        return f"HBM free while the actor sleeps not judged: no --gpu-memory-gb; {stays}"
    if ro["free"] <= 0:
        return (
            f"NO HBM free while the actor sleeps: what stays takes all of the GPU's "
            f"{gb_text(plan['gpu_memory'])}; {stays}"
        )
    return f"{gb_text(ro['free'])} of {gb_text(plan['gpu_memory'])} HBM free while the actor sleeps; {stays}"
