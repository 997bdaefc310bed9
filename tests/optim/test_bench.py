"""``greenroom bench stream`` on the CPU: the report's contract (not its speed) and bad input."""

import json
import os
import subprocess

import pytest

from greenroom.optim.footprint import streamed_bytes_per_param
from tests.cli_support import greenroom, one_line_error

SMALL = [
    "--params",
    "2000000",
    "--bucket-numel",
    "600000",
    "--param-numel",
    "450000",
    "--chunk-mb",
    "8",
    "--raw-size",
    "32MiB",
    "--steps",
    "2",
]


def test_bench_stream_json_reports_the_step_beside_its_disk_bound(disk_dir):
    proc = greenroom(
        "bench", "stream", *SMALL, "--dir", disk_dir, "--moment-dtype", "bf16", "--state-dict", "--json", check_rc=0
    )
    r = json.loads(proc.stdout)
    for name in ("torch_save", "torch_load", "dcp_save", "dcp_load"):
        phase = r["state_dict"][name]
        assert phase["bytes"] >= 8 * 2_000_000 and phase["seconds"] > 0
    # torch.save of the state dict reads the bucket files through their mappings: no anonymous copy
    assert r["state_dict"]["torch_save"]["anon_growth_bytes"] < r["chunk_bytes"] + (1 << 30)
    for key in (
        "step_seconds",
        "disk_bound_seconds",
        "ratio",
        "bytes_read",
        "bytes_written",
        "achieved_bytes_per_s",
        "raw_read_bytes_per_s",
        "raw_write_bytes_per_s",
        "host_rss_peak_bytes",
        "init_host_rss_peak_bytes",
        "page_cache_growth_bytes",
        "peak_device_step_bytes",
        "init_peak_device_bytes",
    ):
        assert key in r
    # The first step reads every bucket and keeps the largest on the device; the second
    # starts on it unread and keeps another (optim.store.held Note [the last bucket stays]).
    first, second = r["steps"]
    assert r["buckets"] == 5 and first["bytes_read"] == r["state_bytes"]
    assert first["bytes_written"] == second["bytes_read"] == second["bytes_written"] == r["bytes_read"]
    assert r["bytes_read"] == r["state_bytes"] - r["kept_bucket_bytes"] > 0
    # bf16 params: the master's low halves (2 B, and its bucket's fingerprints and room for
    # exceptions) + two bf16 moments (2 B each) per param
    assert r["master_layout"] == "remainder"
    counted = streamed_bytes_per_param("bf16", remainder=True) * 2_000_000
    assert counted <= r["state_bytes"] <= counted + r["buckets"] * 5 * 4096
    assert r["full_master_bytes"] == 8 * 2_000_000 and r["full_master_ratio"] < r["ratio"]
    # `greenroom plan` counts the same layout, less the 4 KiB alignment of each bucket's
    # segments (20 KiB at most per bucket: 0.002 % of a default 100M-element bucket).
    plan = json.loads(
        greenroom(
            "plan",
            "--stream-optimizer-state-to-disk",
            "--stream-optimizer-state-moment-dtype",
            "bf16",
            "--offload-train-disk-dir",
            disk_dir,
            "--params",
            "2000000",
            "--world-size",
            "1",
            "--json",
            check_rc=0,
        ).stdout
    )
    assert plan["disk_bytes_per_rank"]["streaming"] == int(counted)
    assert plan["disk_bytes_per_rank"]["streaming"] <= r["state_bytes"] <= counted + r["buckets"] * 5 * 4096
    # The bound is the bench's bytes at the raw rates it measured in the same run.
    assert r["disk_bound_seconds"] > 0 and r["ratio"] > 0
    assert len(r["steps"]) == 2
    assert all(step["cpu_seconds"] > 0 for step in r["steps"])  # the process's CPU seconds in the step
    assert os.listdir(disk_dir) == []  # the bench's rank dir is gone


def test_bench_stream_checkpoint_json_reports_the_in_step_checkpoint_reading_nothing(disk_dir):
    r = json.loads(greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--checkpoint", "--json", check_rc=0).stdout)
    c = r["checkpoint"]
    i = c["in_step"]
    # Beside the bucket files (one filesystem): the checkpoint links the step's own new files.
    assert i["mode"] == "link"
    assert i["extra_bytes_read"] == 0  # every bucket streamed: the checkpoint came from the step's own pass
    assert i["extra_bytes_written"] == 0  # no second write: its files are the step's
    # The step wrote the state once: as a plain step does, and the bucket a plain step keeps
    # on the device (optim.store.held Note [the last bucket stays]) too, as the checkpoint needs it.
    assert r["kept_bucket_bytes"] > 0 and r["compression"].startswith("compression: none")
    assert i["step_disk_bytes_written"] == r["disk_bytes_written"] + r["kept_bucket_bytes"]
    assert i["step_seconds"] > 0 and len(i["plain_step_seconds"]) == 2 and i["ratio"] > 0
    assert i["extra_seconds"] == i["step_seconds"] - sum(i["plain_step_seconds"]) / 2
    assert i["step_after_ratio"] > 0 and i["ratio_to_step_before"] > 0
    # Between steps, beside the bucket files: the save links them (reads their checksum tables only).
    assert c["save_kind"] == "link"
    assert c["save_bytes_written"] == 0 and 0 < c["save_bytes_read"] < r["state_bytes"] // 100
    # The read-back before a linked checkpoint counts: every byte it shares with the live files, once.
    assert i["verify_bytes_read"] == r["state_bytes"] and i["verify_seconds"] > 0
    assert c["save_verify_bytes_read"] == r["state_bytes"] and c["save_verify_seconds"] > 0
    assert c["load_seconds"] > 0
    assert os.listdir(disk_dir) == []


def test_bench_stream_text_report_and_bad_input(disk_dir):
    proc = greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--param-dtype", "fp32", "--checkpoint", check_rc=0)
    assert "verified load" in proc.stdout and "checkpoint in the step" in proc.stdout
    assert "disk bound" in proc.stdout and "step/bound" in proc.stdout and "page cache growth" in proc.stdout
    assert "--params" in one_line_error(greenroom("bench", "stream", "--params", "1.5", "--dir", disk_dir))
    # Named by the train flag the alias stands for.
    assert "--offload-train-disk-dir" in one_line_error(
        greenroom("bench", "stream", "--params", "10", "--dir", os.path.join(disk_dir, "missing"))
    )


def test_bench_stream_with_a_host_cache_moves_only_the_uncached_buckets(disk_dir):
    # bf16 params, fp32 moments: 12 B/param; 5 buckets, one param each: four of 450,000
    # elements (5.4 MB) and one of 200,000 (2.4 MB): 12 MB hold the first two, 40 MB all.
    half = json.loads(
        greenroom(
            "bench",
            "stream",
            *SMALL,
            "--dir",
            disk_dir,
            "--json",
            "--master-layout",
            "fp32",
            "--stream-optimizer-state-host-cache-gb",
            "0.012",
            check_rc=0,
        ).stdout
    )
    assert half["cached_buckets"] == 2 and 0 < half["host_cache_bytes"] <= half["host_cache_budget_bytes"]
    first, second = half["steps"]
    assert first["bytes_written"] == second["bytes_read"] == second["bytes_written"] < first["bytes_read"]
    for step in half["steps"]:
        assert step["disk_bytes"] == step["bytes_read"] + step["bytes_written"]
    assert half["ratio"] > 0
    every = greenroom(
        "bench",
        "stream",
        *SMALL,
        "--dir",
        disk_dir,
        "--master-layout",
        "fp32",
        "--stream-optimizer-state-host-cache-gb",
        "0.04",
        check_rc=0,
    ).stdout
    assert "host cache: 5 of 5 buckets" in every and "no disk I/O, no bandwidth measured (" in every
    assert "disk bound 0 s: the last step moved nothing through the disk (" in every
    assert "5 of 5 buckets in the host cache" in every
    # Nothing written to disk in the last step: no stored ratio, and the files init wrote
    # are not denied.
    assert "written 0 B in the last step (it wrote nothing: " in every
    assert "the files hold what init and earlier steps wrote" in every and "none of the state went" not in every
    assert os.listdir(disk_dir) == []


def test_bench_stream_on_a_run_of_one_bucket_says_nothing_false(disk_dir):
    """One 2M-element param over --bucket-numel 500,000: one bucket, larger than the cap,
    kept on the device after the first step, so the second moves nothing through the
    disk. No "<= 500,000 elements", no host cache where there is none, no "0.00 GB/s"."""
    out = greenroom(
        "bench",
        "stream",
        disk_dir,
        "--params",
        "2000000",
        "--bucket-numel",
        "500000",
        "--param-numel",
        "2000000",
        "--chunk-mb",
        "8",
        "--raw-size",
        "16MiB",
        "--compression",
        "none",
        check_rc=0,
    ).stdout
    assert (
        "1 bucket, largest 2,000,000 elements (20.0 MB): a param over --bucket-numel 500,000 gets a bucket of its own"
    ) in out
    assert "<=" not in out and "host cache" not in out and "0.00 GB" not in out
    [step2] = [line for line in out.splitlines() if line.startswith("step 2:")]
    assert "no disk I/O, no bandwidth measured (the one bucket stayed on the device between steps)" in step2
    assert (
        "disk bound 0 s: the last step moved nothing through the disk (the one bucket stayed on the device "
        "between steps); no step/bound ratio"
    ) in out
    assert "none of the state went to disk" not in out and "1000 such steps write 0 B" in out
    assert os.listdir(disk_dir) == []


def test_bench_stream_master_layout_flag_selects_whole_masters_and_refuses_fp32_params(disk_dir):
    argv = [
        "bench",
        "stream",
        "--params",
        "4000000",
        "--bucket-numel",
        "2000000",
        "--chunk-mb",
        "8",
        "--raw-size",
        "32MiB",
        "--steps",
        "1",
        "--compression",
        "none",
        "--dir",
        disk_dir,
        "--json",
    ]
    r = json.loads(greenroom(*argv, "--stream-optimizer-state-master-layout", "fp32", check_rc=0).stdout)
    assert r["master_layout"] == "fp32" and r["disk_bytes_per_param"] >= 12
    # Where the host memory went, phase by phase (no pinned allocator on a CPU device).
    phases = r["host_rss_phases"]
    assert set(phases) == {"start", "params", "optimizer", "steps"} and r["pinned_host"] is None
    assert all(0 < p["anon"] <= p["rss"] for p in phases.values())
    line = one_line_error(greenroom(*argv, "--param-dtype", "fp32", "--master-layout", "fp32"))
    assert "--stream-optimizer-state-master-layout fp32" in line and "--param-dtype fp32" in line
    assert os.listdir(disk_dir) == []


def test_the_raw_probe_reads_and_writes_at_once_when_asked(disk_dir):
    from greenroom.cli.bench.disk import raw_bandwidth

    both = raw_bandwidth(disk_dir, 8 << 20, block=1 << 20, mixed=True)
    assert both.mixed_read_bytes_per_s > 0 and both.mixed_write_bytes_per_s > 0 and both.read_bytes_per_s > 0
    # The write rate is over written blocks; the write into fresh ones is kept beside it.
    assert both.write_bytes_per_s > 0 and both.first_write_bytes_per_s > 0
    assert raw_bandwidth(disk_dir, 8 << 20, block=1 << 20).mixed_read_bytes_per_s is None
    assert os.listdir(disk_dir) == []  # the scratch file is gone


def test_bench_stream_bf16_params_without_a_codec_move_ten_bytes_per_param(disk_dir):
    # The figure: with the masters as remainders, fp32 moments and no codec, a
    # step reads (and writes) at most 10.05 bytes per param, against 12 with whole masters.
    r = json.loads(
        greenroom(
            "bench",
            "stream",
            "--params",
            "4000000",
            "--bucket-numel",
            "2000000",
            "--chunk-mb",
            "8",
            "--raw-size",
            "32MiB",
            "--steps",
            "1",
            "--param-dtype",
            "bf16",
            "--compression",
            "none",
            "--dir",
            disk_dir,
            "--json",
            check_rc=0,
        ).stdout
    )
    assert r["moment_dtype"] == "fp32" and r["master_layout"] == "remainder"
    assert 10 <= r["disk_bytes_per_param"] <= 10.05
    # One bucket, read by the one step and kept on the device after it (optim.store.held Note
    # [the last bucket stays]): a later step would move none of it.
    assert r["buckets"] == 1 and r["disk_bytes_read"] == r["kept_bucket_bytes"] and r["disk_bytes_written"] == 0
    assert r["full_master_bytes"] == 12 * 4_000_000
    # A second probe after the steps: the ratio against the mean of both bounds lies
    # between the ratios against each.
    assert r["raw_after_read_bytes_per_s"] > 0 and r["raw_after_write_bytes_per_s"] > 0
    after_bound = 12 * 4_000_000 * (1 / r["raw_after_read_bytes_per_s"] + 1 / r["raw_after_write_bytes_per_s"])
    ratios = sorted((r["full_master_ratio"], r["step_seconds"] / after_bound))
    assert ratios[0] <= r["full_master_ratio_bracketed"] <= ratios[1]


def test_against_deepspeed_is_refused_in_one_line_where_it_cannot_run(disk_dir):
    # No DeepSpeed here (a bench-only extra) or no CUDA: one line, exit 2, before any measurement.
    line = one_line_error(greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--against", "deepspeed"))
    assert "--against deepspeed" in line
    assert os.listdir(disk_dir) == []


def test_the_peer_runs_in_a_rank_dir_of_its_own_and_leaves_a_users_deepspeed_nvme_alone(disk_dir):
    """The peer wrote into --dir itself and then deleted DIR/deepspeed-nvme whole, a user's
    dir of that name included. Here the child fails (no DeepSpeed, or no GPU): the cleanup
    runs all the same."""
    import argparse

    from greenroom.cli.bench.peer import beside_deepspeed
    from greenroom.errors import GreenroomError

    theirs = os.path.join(disk_dir, "deepspeed-nvme")
    os.makedirs(theirs)
    with open(os.path.join(theirs, "keep.txt"), "w") as f:
        f.write("mine")
    args = argparse.Namespace(params=1000, dir=disk_dir, steps=1, param_numel=1000, allow_tmpfs=False)
    with pytest.raises(GreenroomError, match="--against deepspeed: the DeepSpeed run failed"):
        beside_deepspeed(args, {})
    assert os.listdir(disk_dir) == ["deepspeed-nvme"] and os.listdir(theirs) == ["keep.txt"]
    with open(os.path.join(theirs, "keep.txt")) as f:
        assert f.read() == "mine"


def test_the_runtime_never_imports_deepspeed():
    import pathlib

    import greenroom

    root = pathlib.Path(greenroom.__file__).parent
    importers = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "import deepspeed" in p.read_text() or "from deepspeed" in p.read_text()
    )
    assert importers == ["cli/bench/deepspeed_peer.py"]  # the peer's child process alone


def test_bench_stream_checkpoint_on_another_filesystem_writes_the_state_twice(disk_dir, tmp_path):
    """--checkpoint-dir on a tmpfs of its own (root only): link() gives EXDEV, so the step
    writes each bucket a second time, from the same staging, and says so once."""
    other = str(tmp_path / "other-fs")
    os.makedirs(other)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", other], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs (another filesystem for the checkpoint) needs root")
    try:
        proc = greenroom(
            "bench",
            "stream",
            *SMALL,
            "--dir",
            disk_dir,
            "--checkpoint",
            "--checkpoint-dir",
            other,
            "--io-only",
            "--json",
            check_rc=0,
        )
        assert json.loads(proc.stdout)["io_only"] is True
        i = json.loads(proc.stdout)["checkpoint"]["in_step"]
        assert i["mode"] == "write" and i["extra_bytes_read"] == 0
        assert i["extra_bytes_written"] == json.loads(proc.stdout)["state_bytes"]
        assert proc.stderr.count("writes every bucket twice") == 1
        assert os.listdir(other) == []
    finally:
        subprocess.run(["umount", other], check=True)


def test_bench_stream_checkpoint_dir_without_checkpoint_is_refused_in_one_line(disk_dir):
    line = one_line_error(
        greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--checkpoint-dir", disk_dir, check_rc=2)
    )
    assert "--checkpoint-dir needs --checkpoint" in line


def test_the_trained_state_from_a_child_process_is_the_one_training_here_gives():
    import dataclasses

    import torch

    from greenroom.cli.bench.trained import train, train_apart

    cpu = torch.device("cpu")
    apart, here = train_apart(cpu, steps=2), train(cpu, steps=2)
    assert apart.steps == here.steps == 2
    for field in dataclasses.fields(here):
        if field.name != "steps":
            assert torch.equal(getattr(apart, field.name), getattr(here, field.name)), field.name


def test_a_failed_child_training_is_one_line_naming_the_flag():
    import torch

    from greenroom.cli.bench.trained import train_apart
    from greenroom.errors import GreenroomError

    with pytest.raises(GreenroomError) as err:
        train_apart(torch.device("cuda", 99))  # no such device, with or without a GPU
    assert "\n" not in str(err.value) and str(err.value).startswith("--state trained:")


def test_the_rss_ratio_beside_deepspeed_spans_init_and_steps_as_the_peers_peak_does():
    from greenroom.cli.bench.peer import ratios

    ours = {
        "step_seconds": 3.0,
        "host_rss_peak_bytes": 100,
        "init_host_rss_peak_bytes": 150,
        "peak_device_total_bytes": 20,
    }
    peer = {"step_seconds": 6.0, "host_rss_peak_bytes": 600, "peak_device_bytes": 10}
    assert ratios(ours, peer) == {"step_ratio": 0.5, "host_rss_ratio": 0.25, "device_ratio": 2.0}
    assert ratios({**ours, "init_host_rss_peak_bytes": 60}, peer)["host_rss_ratio"] == 100 / 600


def test_the_report_beside_deepspeed_gives_both_sides(capsys):
    from greenroom.cli.bench.peer import print_beside

    steps = [{"step_seconds": 14.0, "forward_backward_seconds": 0.5, "cpu_seconds": 90.0, "peak_device_bytes": 6e9}]
    peer = {
        "deepspeed": "0.19.8",
        "params": 10**9,
        "steps": steps,
        "host_rss_peak_bytes": 7e9,
        "peak_device_bytes": 6e9,
        "step_ratio": 0.5,
        "host_rss_ratio": 0.2,
        "device_ratio": 0.5,
    }
    print_beside({"against": peer})
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("DeepSpeed 0.19.8 ZeRO-Infinity") and "CPU in the last step 90.00 s" in out[0]
    assert out[1] == "greenroom / DeepSpeed: step 0.50x, host RSS 0.20x, peak device 0.50x"
