"""``greenroom bench node`` on the CPU: N ranks on one disk at once. The report's contract
(its arithmetic, its verdicts, that every rank's files go), not its speed; and bad input."""

import json
import math
import os

import pytest

from greenroom.cli.bench.node_report import print_text
from tests.cli_support import greenroom, one_line_error

SIZE = 32 << 20
SMALL = ["--params", "2e6", "--size", "32MiB", "--raw-size", "32MiB", "--chunk-mb", "8", "--device", "cpu"]


def close(a: float, b: float) -> bool:
    """Equal but for the order of float additions (the bench sums in its own order)."""
    return math.isclose(a, b, rel_tol=1e-12)


def test_bench_node_reports_aggregate_spread_and_plan_per_rank_count(disk_dir, capsys):
    proc = greenroom(
        "bench", "node", disk_dir, "--ranks", "1,2", *SMALL, "--compression", "none", "--json", timeout=600, check_rc=0
    )
    r = json.loads(proc.stdout)
    assert r["ranks"] == [1, 2] and [run["ranks"] for run in r["runs"]] == [1, 2]
    # each N's aggregates reach stderr as it ends, so a run cut short keeps its figures so far
    done = [line for line in proc.stderr.splitlines() if "bench node: " in line and " done, raw read " in line]
    assert [line.split("bench node: ")[1].split(" rank")[0] for line in done] == ["1", "2"], proc.stderr
    assert all("; step " in line and ", plan/measured " in line for line in done), proc.stderr
    # One probe per rank count, at its concurrency: --raw-size per rank, reads beside writes.
    for run in r["runs"]:
        raw = run["raw"]
        assert raw["bytes"] == SIZE * run["ranks"] and raw["read_bytes_per_s"] > 0 and raw["write_bytes_per_s"] > 0
        assert raw["mixed_read_bytes_per_s"] > 0 and raw["mixed_write_bytes_per_s"] > 0
        assert raw["first_write_bytes_per_s"] > 0
    assert r["raw"] == r["runs"][0]["raw"]
    assert r["targets"] == {"vs_one_rank_at_least": 0.9, "spread_at_most": 1.1, "plan_within": 0.15}
    aggregate_one = {}
    for run in r["runs"]:
        n, raw = run["ranks"], run["raw"]
        ranks = run["rank_figures"]
        assert len(ranks) == n and run["bit_exact"]
        for rank in ranks:
            assert [len(rank[p]) for p in ("step", "sleep", "wake")] == [2, 2, 2]  # --steps 2, --cycles 2
            # The first step reads every bucket; the second moves the 3 of 4 buckets it does
            # not keep each way. Every sleep writes the whole actor (no codec) and every wake
            # reads it back.
            assert rank["step"][0]["read"] == rank["state_bytes"] > 0
            assert rank["step"][1]["read"] == rank["step"][1]["written"] == rank["state_bytes"] * 3 // 4
            assert all(c["written"] == SIZE and c["read"] == 0 for c in rank["sleep"])
            assert all(c["read"] == SIZE and c["written"] == 0 for c in rank["wake"])
        for name in ("step", "sleep", "wake"):
            p = run["phases"][name]
            per = [rank[name] for rank in ranks]
            # The definitions the docs give: each rank's seconds summed over the instances;
            # the node's seconds of an instance are its slowest rank's.
            rank_seconds = [sum(i["seconds"] for i in instances) for instances in per]
            wall = sum(max(instances[j]["seconds"] for instances in per) for j in range(2))
            read = sum(i["read"] for instances in per for i in instances)
            written = sum(i["written"] for instances in per for i in instances)
            assert p["rank_seconds"] == rank_seconds and close(p["wall_seconds"], wall)
            assert p["bytes_read"] == read and p["bytes_written"] == written and p["bytes"] == read + written
            assert close(p["aggregate_bytes_per_s"], (read + written) / wall)
            mean = sum(rank_seconds) / n
            assert all(close(a, s / mean) for a, s in zip(p["rank_over_mean"], rank_seconds))
            assert close(p["spread"], max(rank_seconds) / mean)
            bound = read / raw["read_bytes_per_s"] + written / raw["write_bytes_per_s"]
            assert close(p["disk_bound_seconds"], bound) and close(p["of_disk_bound"], bound / wall)
            # What `greenroom plan --measure-disk` says of N ranks on this disk: each rank
            # gets 1/N of N's probe's rates; a step reads and writes back its streamed bytes
            # at once, at the mixed rates; a sleep writes the actor's stored bytes and a wake
            # reads them.
            per_rank = (read + written) / 2 / (2 * n) if name == "step" else (read + written) / (2 * n)
            assert close(p["plan_bytes_per_rank"], per_rank)
            rate_read, rate_write = raw["read_bytes_per_s"] / n, raw["write_bytes_per_s"] / n
            mixed_read, mixed_write = raw["mixed_read_bytes_per_s"] / n, raw["mixed_write_bytes_per_s"] / n
            expected = {
                "step": max(per_rank / mixed_read, per_rank / mixed_write),
                "sleep": per_rank / rate_write,
                "wake": per_rank / rate_read,
            }[name]
            assert close(p["plan_seconds"], expected)
            assert close(p["measured_seconds"], wall / 2)
            assert close(p["plan_ratio"], p["plan_seconds"] / p["measured_seconds"])
            if n == 1:
                aggregate_one[name] = p["aggregate_bytes_per_s"]
            assert close(p["vs_one_rank"], p["aggregate_bytes_per_s"] / aggregate_one[name])
            assert p["targets_met"] == {
                "vs_one_rank": p["vs_one_rank"] >= 0.9,
                "spread": p["spread"] <= 1.1,
                "plan": abs(p["plan_ratio"] - 1) <= 0.15,
            }
    assert r["runs"][0]["phases"]["step"]["vs_one_rank"] == 1.0
    assert os.listdir(disk_dir) == []  # every rank's dir, and the parent probe's, are gone

    # The text report: one line per rank count and phase, with a verdict per target.
    print_text(r)
    lines = capsys.readouterr().out.splitlines()
    table = [line.split() for line in lines if line.split()[:1] in (["1"], ["2"])]
    assert [(row[0], row[1]) for row in table] == [(n, p) for n in "12" for p in ("step", "sleep", "wake")]
    for row, (run, name) in zip(table, [(run, p) for run in r["runs"] for p in ("step", "sleep", "wake")]):
        met = run["phases"][name]["targets_met"]
        words = ["met" if met[k] else "MISSED" for k in ("vs_one_rank", "spread", "plan")]
        assert row[-5:] == [words[0], "/", words[1], "/", words[2]]
    assert "every rank's actor bit-exact after its last wake: True" in lines


@pytest.mark.parametrize(
    ("ranks", "says"),
    [
        ("0", "each rank count must be 1 to 64, got 0"),
        ("1,x", "comma-separated list of rank counts"),
        ("1,-2", "each rank count must be 1 to 64, got -2"),
        ("1,1", "1 is given twice"),
        ("2,4", "the list must hold 1"),
    ],
)
def test_bench_node_refuses_a_bad_rank_list_in_one_line(disk_dir, ranks, says):
    line = one_line_error(greenroom("bench", "node", disk_dir, "--ranks", ranks, *SMALL))
    assert "--ranks" in line and says in line
    assert os.listdir(disk_dir) == []  # nothing was made


def test_bench_node_refuses_a_memory_backed_dir_in_one_line(tmp_path):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here to stand for a memory-backed dir")
    line = one_line_error(greenroom("bench", "node", "/dev/shm", "--ranks", "1", *SMALL))
    assert "--offload-train-disk-dir /dev/shm" in line and "RAM" in line
