"""`greenroom plan` as the run's budget, against figures computed by hand.

Three shapes: the seed's (GLM-5.2 744B on 8 nodes of 4 GPUs at DP=1), a 7B run at DP=8 on
one node, and a 70B run at TP=8 x DP=8 on 8 nodes of 8. Codec ``none`` where bytes are
checked, so the stored bytes equal the raw ones; the codec's expected ratios have their
own test in tests/io/test_compression.py.
"""

import json
import os
import re

import pytest

from greenroom.cli import plan as plan_cli
from greenroom.cli.budget import Layout
from greenroom.config import OffloadFlags
from tests.cli_support import greenroom, one_line_error

GB = 1e9
BUCKET_DEVICE_BYTES_FP32 = 100e6 * (3 * 12 + 4)  # three 100M-element buckets of 12 B + the fp32 grad scratch


def plan(flags: dict, **layout) -> dict:
    gpu = layout.pop("gpu_memory_gb", None)
    host = layout.pop("host_memory_gb", None)
    disk = layout.pop("disk_gbps", None)
    flags = {"offload_train_disk_compression": "none", **flags}
    return plan_cli.build_plan(
        OffloadFlags(**flags),
        Layout(**layout),
        role="actor",
        job="j",
        gpu_memory_gb=gpu,
        host_memory_gb=host,
        disk_gbps=disk,
    )


SEED = {"params": 744_000_000_000, "world_size": 32, "nproc_per_node": 4, "data_parallel": 1}


def test_the_seeds_shape_needs_streaming():
    # Masters whole, as the seed's figures are (its optimizer stores fp32 mains).
    p = plan(
        {"stream_optimizer_state_to_disk": True, "stream_optimizer_state_master_layout": "fp32"},
        **SEED,
        gpu_memory_gb=276.6,
        disk_gbps=(8.0, 4.0),
    )
    r = p["per_rank"]
    assert p["model_parallel"] == 32
    # 744e9 / 32 = 23.25e9 params per rank; bf16 weights and grads 2 B each.
    assert r["model_params"] == r["optimizer_params"] == 23_250_000_000
    assert r["weights"] == r["grads"] == 46_500_000_000
    # fp32 master + two fp32 moments: 12 B x 23.25e9 = 279 GB (the seed's figure).
    assert r["optimizer_state"] == r["optimizer_state_stored"] == 279_000_000_000
    assert r["gpu"]["without_streaming"] == 372_000_000_000
    assert r["gpu"]["with_streaming"] == 93_000_000_000 + BUCKET_DEVICE_BYTES_FP32
    assert p["fits_gpu"] == {"without_streaming": False, "with_streaming": True}
    assert r["disk"] == {"streaming": 279_000_000_000, "offload": 0, "total": 279_000_000_000}
    assert p["per_node"]["disk"]["total"] == 4 * 279_000_000_000
    assert r["host"] == {"staging": 256 << 20, "host_cache": 0, "pinned_actor_copy": 0, "total": 256 << 20}
    assert p["per_node"]["host"]["total"] == 4 * (256 << 20)
    # 8 GB/s read and 4 GB/s write per node, shared by 4 ranks: 2 and 1 GB/s per rank;
    # a step reads and writes back 279 GB: 139.5 s + 279 s.
    assert p["seconds"]["streamed_step"] == pytest.approx(418.5)
    assert "sleep" not in p["seconds"] and p["problems"] == []
    # Without streaming the same run is refused, and told what to add.
    resident = plan({}, **SEED, gpu_memory_gb=276.6)
    assert resident["per_rank"]["optimizer_state"] == 279_000_000_000
    assert resident["problems"] == [
        "the model state needs 372.0 GB per rank without streaming, the GPU has 276.6 GB: "
        "add --stream-optimizer-state-to-disk: 97.0 GB per rank"
    ]


def test_the_seeds_command_as_the_issue_gives_it(monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    env = {k: v for k, v in os.environ.items() if k != "SCRATCH"}
    proc = greenroom(
        "plan",
        "--params",
        "744e9",
        "--world-size",
        "32",
        "--nproc-per-node",
        "4",
        "--data-parallel",
        "1",
        "--gpu-memory-gb",
        "276.6",
        "--stream-optimizer-state-to-disk",
        "--json",
        env=env,
        check_rc=0,
    )
    p = json.loads(proc.stdout)
    assert p["per_rank"]["optimizer_state"] == int(23_250_000_000 * REMAINDER_12)  # masters as remainders
    assert p["fits_gpu"] == {"without_streaming": False, "with_streaming": True}
    assert "disk_dir" not in p  # no dir anywhere: the budget, without the free-space check
    text = greenroom(
        "plan",
        "--params",
        "744B",
        "--world-size",
        "32",
        "--nproc-per-node",
        "4",
        "--data-parallel",
        "1",
        "--gpu-memory-gb",
        "276.6",
        "--stream-optimizer-state-to-disk",
        env=env,
        check_rc=0,
    ).stdout
    assert (
        "optimizer state 232.8 GB (23,250,000,000 params, 10.014 B/param streamed)" in text
        and "without streaming 372.0 GB (DOES NOT FIT)" in text
    )


SEVEN_B = {"params": 7_000_000_000, "world_size": 8, "nproc_per_node": 8, "data_parallel": 8}


def test_7b_at_dp8():
    p = plan({}, **SEVEN_B, gpu_memory_gb=80)
    r = p["per_rank"]
    assert p["model_parallel"] == 1
    # DDP: every rank holds all 7e9 params: 14 + 14 + 84 GB.
    assert (r["weights"], r["grads"], r["optimizer_state"]) == (14e9, 14e9, 84e9)
    assert p["fits_gpu"] == {"without_streaming": False, "with_streaming": True}
    # ZeRO-1 divides the optimizer state by 8: 10.5 GB, 38.5 GB in all.
    zero1 = plan({}, **SEVEN_B, sharding="optimizer", gpu_memory_gb=80)
    assert zero1["per_rank"]["optimizer_state"] == 10.5e9 and zero1["per_rank"]["gpu"]["without_streaming"] == 38.5e9
    assert zero1["problems"] == []
    # FSDP divides the weights and grads too: 1.75 + 1.75 + 10.5 GB.
    fsdp = plan({}, **SEVEN_B, sharding="full", gpu_memory_gb=80)
    assert fsdp["per_rank"]["gpu"]["without_streaming"] == 14e9
    # Streaming with bf16 moments, masters whole: 4 + 2 + 2 = 8 B/param on disk, 56 GB per rank, 448 GB per node.
    bf16 = plan(
        {
            "stream_optimizer_state_to_disk": True,
            "stream_optimizer_state_moment_dtype": "bf16",
            "stream_optimizer_state_master_layout": "fp32",
        },
        **SEVEN_B,
    )
    assert bf16["per_rank"]["disk"]["streaming"] == 56e9 and bf16["per_node"]["disk"]["total"] == 448e9
    assert bf16["per_rank"]["gpu"]["with_streaming"] == 28e9 + 100e6 * (3 * 8 + 4)


def test_a_state_of_fewer_buckets_than_buffers_is_sized_with_as_many_buffers():
    # 150M params: two buckets (100M and 50M), so a step holds two bucket buffers, not three.
    small = plan(
        {"stream_optimizer_state_to_disk": True}, params=150_000_000, world_size=1, nproc_per_node=1, data_parallel=1
    )
    assert small["per_rank"]["gpu"]["with_streaming"] == 150e6 * (2 + 2) + 100e6 * (2 * 12 + 4)
    # 50M params: one bucket of 50M elements.
    tiny = plan(
        {"stream_optimizer_state_to_disk": True}, params=50_000_000, world_size=1, nproc_per_node=1, data_parallel=1
    )
    assert tiny["per_rank"]["gpu"]["with_streaming"] == 50e6 * (2 + 2) + 50e6 * (1 * 12 + 4)


SEVENTY_B = {"params": 70_000_000_000, "world_size": 64, "nproc_per_node": 8, "data_parallel": 8}


def test_70b_at_tp8_dp8():
    p = plan({}, **SEVENTY_B, gpu_memory_gb=80)
    r = p["per_rank"]
    # TP=8: 8.75e9 params per rank; 17.5 + 17.5 + 105 = 140 GB.
    assert p["model_parallel"] == 8 and r["model_params"] == 8.75e9
    assert r["gpu"]["without_streaming"] == 140e9 and p["fits_gpu"]["without_streaming"] is False
    zero1 = {**SEVENTY_B, "sharding": "optimizer", "gpu_memory_gb": 80}
    # Distributed optimizer: 105 / 8 = 13.125 GB of state; 48.125 GB fits 80.
    assert plan({}, **zero1)["per_rank"]["gpu"]["without_streaming"] == 48.125e9
    # cpu target: each rank pins a copy of its paused actor (48.125 GB), 385 GB per node.
    cpu = {"offload_train": True}
    assert plan(cpu, **zero1, host_memory_gb=512)["per_node"]["host"]["total"] == 385e9
    assert plan(cpu, **zero1, host_memory_gb=512)["problems"] == []
    small = plan(cpu, **zero1, host_memory_gb=256)
    assert small["fits_host"] is False and "need 385.0 GB of host memory" in small["problems"][0]
    # disk target: the same 48.125 GB per rank go to disk; 16/8 GB/s per node over 8 ranks
    # is 2/1 GB/s per rank: sleep 48.125 s, wake 24.0625 s.
    disk = plan({"offload_train": True, "offload_train_target": "disk"}, **zero1, disk_gbps=(16.0, 8.0))
    assert disk["per_rank"]["disk"]["offload"] == 48.125e9 and disk["per_rank"]["host"]["staging"] == 256 << 20
    assert disk["seconds"]["sleep"] == pytest.approx(48.125) and disk["seconds"]["wake"] == pytest.approx(24.0625)


def test_a_node_of_ranks_is_checked_against_the_nodes_host_memory():
    # The issue's case: 5 GB of host cache x 8 ranks on a 23 GB machine.
    flags = {"stream_optimizer_state_to_disk": True, "stream_optimizer_state_host_cache_gb": 5.0}
    p = plan(flags, params=70_000_000_000, world_size=8, nproc_per_node=8, data_parallel=8, host_memory_gb=23)
    assert p["per_rank"]["host"]["host_cache"] == 5e9 and p["fits_host"] is False


def test_plan_cli_refuses_what_does_not_fit_in_one_line():
    proc = greenroom(
        "plan",
        "--params",
        "70B",
        "--world-size",
        "64",
        "--nproc-per-node",
        "8",
        "--data-parallel",
        "8",
        "--gpu-memory-gb",
        "80",
    )
    assert "the model state needs 140.0 GB per rank without streaming" in one_line_error(proc)


def test_a_plan_of_fewer_params_than_model_parallel_ranks_reports_instead_of_dividing_by_zero(disk_dir):
    """1 param over 10 model-parallel ranks: each rank stores 0 bytes of it, and the
    compression line divided by that (a ZeroDivisionError traceback)."""
    proc = greenroom(
        "plan",
        "--params",
        "1",
        "--world-size",
        "10",
        "--data-parallel",
        "1",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--offload-train-disk-compression",
        "zstd",
        check_rc=0,
    )
    assert "verdict:" in proc.stdout and "Traceback" not in proc.stderr


def test_plan_measures_the_disk_when_asked(disk_dir):
    """``--measure-disk`` runs doctor's probe on the disk dir at the node's rank count; the
    seconds follow from it, the step from the rates of reads and writes at once."""
    proc = greenroom(
        "plan",
        "--params",
        "1e6",
        "--world-size",
        "2",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--offload-train-disk-compression",
        "none",
        "--measure-disk",
        "--json",
        check_rc=0,
    )
    p = json.loads(proc.stdout)
    d = p["disk_gbps"]
    assert d["source"] == "measured" and d["read"] > 0 and d["mixed_read"] > 0 and d["mixed_write"] > 0
    read, write = p["seconds"]["read_bytes_per_s_per_rank"], p["seconds"]["write_bytes_per_s_per_rank"]
    # Two ranks on the node share its rates.
    assert read == pytest.approx(d["read"] * 1e9 / 2) and write == pytest.approx(d["write"] * 1e9 / 2)
    # 1e6 bf16 params on each of the 2 data-parallel ranks: 10.014 MB streamed per step each
    # way (masters as remainders), read and written at once; 4 MB of weights and grads per sleep.
    step = int(1e6 * REMAINDER_12)
    mixed_read, mixed_write = d["mixed_read"] * 1e9 / 2, d["mixed_write"] * 1e9 / 2
    assert p["seconds"]["streamed_step"] == pytest.approx(max(step / mixed_read, step / mixed_write))
    assert p["seconds"]["sleep"] == pytest.approx(4e6 / write) and p["seconds"]["wake"] == pytest.approx(4e6 / read)
    # The text says where the rates come from and how the step is planned.
    args = [a for a in proc.args[proc.args.index("plan") :] if a != "--json"]
    out = greenroom(*args, check_rc=0).stdout
    assert re.search(
        r"^time:       disk \d+\.\d\d/\d+\.\d\d GB/s read/write per node \(\d+\.\d\d/\d+\.\d\d at once; measured at "
        r"2 rank\(s\)' concurrency\): streamed step \d+\.\d s \(its reads and writes at once\), sleep ",
        out,
        re.M,
    ), out


def test_a_plan_without_streaming_gives_no_streamed_step_time():
    # No "streamed step 0.0 s" (nor streamed_step 0.0 in --json) for a run that streams nothing.
    disk = plan({"offload_train": True, "offload_train_target": "disk"}, **SEVENTY_B, disk_gbps=(16.0, 8.0))
    assert "streamed_step" not in disk["seconds"] and "sleep" in disk["seconds"]
    out = greenroom("plan", "--params", "1e6", "--disk-read-gbps", "2", "--disk-write-gbps", "1", check_rc=0).stdout
    assert "time:       disk 2/1 GB/s read/write per node (given): nothing of this plan moves through the disk" in out
    assert "streamed step" not in out


# -- what plan prints is what the run does ---------------------------------------------

REMAINDER_12 = 2 + 8 / 4096 + 12 / 1024 + 8  # bf16 param, master as a remainder, two fp32 moments


def test_disk_and_time_are_sized_with_the_master_layout_the_plan_prints():
    """The seed's shape streams its masters as remainders by default: 10.014 B/param on
    disk, not 12 (279 GB) per rank, and the streamed step moves those bytes."""
    p = plan({"stream_optimizer_state_to_disk": True}, **SEED, gpu_memory_gb=276.6, disk_gbps=(8.0, 4.0))
    per_rank = 23_250_000_000 * REMAINDER_12
    assert p["master_layout"] == "remainder" and p["optimizer_bytes_per_param"] == pytest.approx(REMAINDER_12)
    assert p["per_rank"]["optimizer_state"] == int(per_rank) == p["per_rank"]["disk"]["streaming"]
    assert p["per_rank"]["optimizer_state_stored"] == int(per_rank)
    assert p["seconds"]["streamed_step"] == pytest.approx(per_rank / 2e9 + per_rank / 1e9)
    whole = plan(
        {"stream_optimizer_state_to_disk": True, "stream_optimizer_state_master_layout": "fp32"},
        **SEED,
        disk_gbps=(8.0, 4.0),
    )
    assert whole["per_rank"]["disk"]["streaming"] == 279_000_000_000
    assert whole["seconds"]["streamed_step"] == pytest.approx(418.5)
    # fp16 params have no remainder layout: their masters are stored whole.
    fp16 = plan({"stream_optimizer_state_to_disk": True}, **SEED, param_dtype="fp16")
    assert fp16["per_rank"]["disk"]["streaming"] == 279_000_000_000


def test_the_advice_shards_the_optimizer_state_before_it_streams():
    """The README's 7B and 70B examples fit with --sharding optimizer (no disk traffic);
    the seed's shape, at DP=1, can only stream."""
    seven = plan({}, **SEVEN_B, gpu_memory_gb=80)
    assert seven["problems"] == [
        "the model state needs 112.0 GB per rank without streaming, the GPU has 80.0 GB: use "
        "--sharding optimizer (ZeRO-1, Megatron's distributed optimizer): 38.5 GB per rank"
    ]
    seventy = plan({}, **SEVENTY_B, gpu_memory_gb=80)
    assert seventy["problems"] == [
        "the model state needs 140.0 GB per rank without streaming, the GPU has 80.0 GB: "
        "use --sharding optimizer (ZeRO-1, Megatron's distributed optimizer): 48.1 GB per "
        "rank"
    ]
    seed = plan({}, **SEED, gpu_memory_gb=276.6)
    assert seed["problems"] == [
        "the model state needs 372.0 GB per rank without streaming, the GPU has 276.6 GB: "
        "add --stream-optimizer-state-to-disk: 97.0 GB per rank"
    ]
    # 70B at DP=8 on 40 GB GPUs: ZeRO-1 (48.1 GB) does not fit, FSDP (17.5 / 8 x 2 + 13.1 = 17.5 GB) does.
    assert (
        "use --sharding full (FSDP, ZeRO-3): 17.5 GB per rank" in plan({}, **SEVENTY_B, gpu_memory_gb=40)["problems"][0]
    )


def test_the_disk_advice_names_what_each_change_leaves_per_node(tmp_path):
    """A disk too small for the node: each change with the bytes it leaves per node; no
    narrower moments where nothing streams, and fewer ranks per node, not more."""
    flags = {"offload_train": True, "offload_train_target": "disk", "offload_train_disk_dir": str(tmp_path)}
    [line] = plan(flags, params=10**15, world_size=8, nproc_per_node=8, data_parallel=8)["problems"]
    assert "moment" not in line and "more ranks" not in line
    assert "--sharding optimizer (" in line and "--offload-train-target cpu (0 B per node)" in line
    assert "fewer ranks per node (each needs " in line
    streaming = plan(
        {"stream_optimizer_state_to_disk": True, "offload_train_disk_dir": str(tmp_path)},
        params=10**15,
        world_size=8,
        nproc_per_node=8,
        data_parallel=8,
    )
    [line] = streaming["problems"]
    # 10.014 B/param over 8 ranks per node; bf16 moments leave 6.014 B/param.
    assert "--stream-optimizer-state-moment-dtype bf16 (48.1 PB per node)" in line  # 6.014 B x 1e15 x 8
    assert line.startswith(f"{tmp_path} has ")
    assert "the node's 8 rank(s) need 80.1 PB: --sharding optimizer (10.0 PB per node)" in line


def test_plan_states_its_codec_and_resolves_auto_as_train_does():
    from importlib.util import find_spec

    try:
        nvcomp = find_spec("nvidia.nvcomp") is not None
    except ModuleNotFoundError:
        nvcomp = False
    auto = plan({"stream_optimizer_state_to_disk": True, "offload_train_disk_compression": "auto"}, **SEED)
    assert auto["compression"] == ("nvcomp-ans" if nvcomp else "none")
    if not nvcomp:  # as train runs here: none, so the stored bytes are the raw ones
        assert auto["per_rank"]["optimizer_state_stored"] == auto["per_rank"]["optimizer_state"]
        assert "the nvCOMP wheel is not installed here" in auto["compression_line"]
    given = plan({"stream_optimizer_state_to_disk": True, "offload_train_disk_compression": "nvcomp-ans"}, **SEED)
    assert given["compression"] == "nvcomp-ans"
    assert given["per_rank"]["optimizer_state_stored"] < given["per_rank"]["optimizer_state"]
    out = greenroom(
        "plan",
        "--params",
        "1e6",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-compression",
        "nvcomp-ans",
        env={"SCRATCH": ""},
        check_rc=0,
    ).stdout
    assert "codec:      nvcomp-ans (--offload-train-disk-compression)" in out


def test_plan_text_gives_the_disk_answer_without_a_disk_dir_and_judges_host_memory_only_when_given(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("SCRATCH", "GREENROOM_DISK_DIR")}
    argv = [
        "plan",
        "--params",
        "744B",
        "--world-size",
        "32",
        "--nproc-per-node",
        "4",
        "--data-parallel",
        "1",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-compression",
        "none",
    ]
    out = greenroom(*argv, env=env, check_rc=0).stdout
    assert "disk per rank: 232.8 GB (streamed state 232.8 GB, paused actor 0 B); per node 931.3 GB" in out
    assert "free space not checked" in out
    assert "host memory: 268.4 MB per rank, 1.1 GB for the node's 4 rank(s) (not judged: no --host-memory-gb)" in out
    p = json.loads(greenroom(*argv, "--json", env=env, check_rc=0).stdout)
    assert p["fits_host"] is None and p["host_memory_per_node"] is None
    judged = json.loads(greenroom(*argv, "--host-memory-gb", "512", "--json", env=env, check_rc=0).stdout)
    assert judged["fits_host"] is True and judged["host_memory_per_node"] == 512_000_000_000


def test_plan_reports_the_hbm_the_rollout_engine_gets_while_the_actor_sleeps():
    zero1 = {**SEVENTY_B, "sharding": "optimizer", "gpu_memory_gb": 80}
    # Offloaded: the actor keeps none of its 48.125 GB; the CUDA context (0.5) and NCCL (1.0) stay.
    asleep = plan({"offload_train": True}, **zero1)["rollout"]
    assert asleep == {"actor_keeps": 0, "cuda_context": 500_000_000, "nccl": 1_000_000_000, "free": 78_500_000_000}
    # Not offloaded: the actor keeps its whole model state.
    awake = plan({}, **zero1)["rollout"]
    assert awake["actor_keeps"] == 48_125_000_000 and awake["free"] == 80e9 - 48.125e9 - 1.5e9
    # Assumptions are flags; without --gpu-memory-gb the free HBM is not judged.
    p = plan_cli.build_plan(
        OffloadFlags(offload_train=True),
        Layout(**SEVENTY_B),
        role="actor",
        job="j",
        gpu_memory_gb=80,
        cuda_context_gb=0.0,
        nccl_gb=4.0,
    )
    assert p["rollout"]["free"] == 76_000_000_000
    out = greenroom(
        "plan",
        "--params",
        "70B",
        "--world-size",
        "64",
        "--nproc-per-node",
        "8",
        "--data-parallel",
        "8",
        "--sharding",
        "optimizer",
        "--offload-train",
        "--gpu-memory-gb",
        "80",
        check_rc=0,
    ).stdout
    [line] = [text for text in out.splitlines() if text.startswith("rollout:")]
    assert line.startswith("rollout:    78.5 GB of 80.0 GB HBM free while the actor sleeps; the actor keeps none")
    assert "the CUDA context 0.5 GB and NCCL's buffers 1.0 GB stay (assumed: --cuda-context-gb, --nccl-gb" in line
    full = greenroom(
        "plan",
        "--params",
        "7B",
        "--gpu-memory-gb",
        "80",
        "--world-size",
        "8",
        "--sharding",
        "optimizer",
        "--nccl-gb",
        "45",
        check_rc=0,
    ).stdout  # 38.5 GB kept + 0.5 + 45 GB of NCCL
    assert "rollout:    NO HBM free while the actor sleeps: what stays takes all of the GPU's 80.0 GB" in full
    none = greenroom("plan", "--params", "7B", "--offload-train", check_rc=0).stdout
    assert "rollout:    HBM free while the actor sleeps not judged: no --gpu-memory-gb" in none


def test_the_disk_advice_for_the_seeds_shape(tmp_path):
    """The seed's shape on a node whose disk holds less than its 4 ranks' 931.3 GB: at
    DP=1 nothing shards, so bf16 moments, fewer ranks per node or a larger disk."""
    p = plan({"stream_optimizer_state_to_disk": True, "offload_train_disk_dir": str(tmp_path)}, **SEED)
    if p["free_bytes"] >= p["disk_bytes_per_node"]:
        pytest.skip("this disk holds the seed's 931 GB per node")
    [line] = p["problems"]
    assert line.endswith(
        "the node's 4 rank(s) need 931.3 GB: --stream-optimizer-state-moment-dtype bf16 (559.3 GB "
        "per node); or fewer ranks per node (each needs 232.8 GB; more nodes or more model "
        "parallelism); or a disk dir with more free space"
    )
