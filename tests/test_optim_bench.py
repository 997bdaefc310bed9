"""``greenroom bench stream`` on the CPU: the report's contract (not its speed) and bad input."""

import json
import os

from tests.cli_support import greenroom, one_line_error

SMALL = ["--params", "2000000", "--bucket-numel", "600000", "--param-numel", "450000", "--chunk-mb", "8",
         "--raw-gib", "0.03125", "--steps", "2"]


def test_bench_stream_json_reports_the_step_beside_its_disk_bound(disk_dir):
    proc = greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--moment-dtype", "bf16", "--state-dict", "--json",
                     check_rc=0)
    r = json.loads(proc.stdout)
    for name in ("torch_save", "torch_load", "dcp_save", "dcp_load"):
        phase = r["state_dict"][name]
        assert phase["bytes"] >= 8 * 2_000_000 and phase["seconds"] > 0
    # torch.save of the state dict reads the bucket files through their mappings: no anonymous copy
    assert r["state_dict"]["torch_save"]["anon_growth_bytes"] < r["chunk_bytes"] + (1 << 30)
    for key in ("step_seconds", "disk_bound_seconds", "ratio", "bytes_read", "bytes_written", "achieved_bytes_per_s",
                "raw_read_bytes_per_s", "raw_write_bytes_per_s", "host_rss_peak_bytes", "page_cache_growth_bytes",
                "peak_device_step_bytes", "init_peak_device_bytes"):
        assert key in r
    # bf16 params: fp32 master (4 B) + two bf16 moments (2 B each) per param, all read and written
    assert r["buckets"] == 5 and r["bytes_read"] == r["bytes_written"] == r["state_bytes"]
    assert 8 * 2_000_000 <= r["state_bytes"] < 8 * 2_000_000 + 5 * 3 * 4096
    # The bench's bytes agree with `greenroom plan`'s independent count, up to the files'
    # alignment and checksum tables (one 4 KiB page per segment, one per table).
    plan = json.loads(greenroom("plan", "--stream-optimizer-state-to-disk", "--stream-optimizer-state-moment-dtype",
                                "bf16", "--offload-train-disk-dir", disk_dir, "--params", "2000000",
                                "--world-size", "1", "--json", check_rc=0).stdout)
    planned = plan["disk_bytes_per_rank"]["streaming"]
    assert planned <= r["state_bytes"] <= planned + r["buckets"] * 4 * 4096
    # The bound is the bench's bytes at the raw rates it measured in the same run.
    assert r["disk_bound_seconds"] > 0 and r["ratio"] > 0
    assert len(r["steps"]) == 2
    assert os.listdir(disk_dir) == []  # the bench's rank dir is gone


def test_bench_stream_checkpoint_json_reports_the_in_step_checkpoint_reading_nothing(disk_dir):
    r = json.loads(greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--checkpoint", "--json",
                             check_rc=0).stdout)
    c = r["checkpoint"]
    i = c["in_step"]
    assert i["extra_bytes_read"] == 0  # every bucket streamed: the checkpoint came from the step's own pass
    assert i["extra_bytes_written"] == r["state_bytes"]  # its second write, the whole state
    assert i["step_seconds"] > 0 and len(i["plain_step_seconds"]) == 2 and i["ratio"] > 0
    assert i["extra_seconds"] == i["step_seconds"] - sum(i["plain_step_seconds"]) / 2
    # Between steps: ext4 and tmpfs cannot clone, so the save copies (reads and writes the state once).
    assert c["save_kind"] in ("clone", "copy")
    if c["save_kind"] == "copy":
        assert c["save_bytes_read"] == c["save_bytes_written"] == r["state_bytes"]
    assert c["load_seconds"] > 0
    assert os.listdir(disk_dir) == []


def test_bench_stream_text_report_and_bad_input(disk_dir):
    proc = greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--param-dtype", "fp32", "--checkpoint",
                     check_rc=0)
    assert "verified load" in proc.stdout and "checkpoint in the step" in proc.stdout
    assert "disk bound" in proc.stdout and "step/bound" in proc.stdout and "page cache growth" in proc.stdout
    assert "--params" in one_line_error(greenroom("bench", "stream", "--params", "1.5", "--dir", disk_dir))
    assert "--dir" in one_line_error(greenroom("bench", "stream", "--params", "10", "--dir",
                                               os.path.join(disk_dir, "missing")))


def test_bench_stream_with_a_host_cache_moves_only_the_uncached_buckets(disk_dir):
    # bf16 params, fp32 moments: 12 B/param; 5 buckets, one param each: four of 450,000
    # elements (5.4 MB) and one of 200,000 (2.4 MB): 12 MB hold the first two, 40 MB all.
    half = json.loads(greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--json",
                                "--stream-optimizer-state-host-cache-gb", "0.012", check_rc=0).stdout)
    assert half["cached_buckets"] == 2 and 0 < half["host_cache_bytes"] <= half["host_cache_budget_bytes"]
    for step in half["steps"]:
        assert step["bytes_read"] == step["bytes_written"] < half["state_bytes"]
        assert step["disk_bytes"] == step["bytes_read"] + step["bytes_written"]
    assert half["ratio"] > 0
    every = greenroom("bench", "stream", *SMALL, "--dir", disk_dir, "--stream-optimizer-state-host-cache-gb", "0.04",
                      check_rc=0).stdout
    assert "host cache: 5 of 5 buckets" in every and "on disk 0.00 GB" in every
    assert "every bucket is in the host cache" in every
    assert os.listdir(disk_dir) == []
