"""``greenroom bench offload`` on the CPU, small: it reports its bound and checks bytes.

(Speed is what the benchmark measures, on the GPU machine; here only its contract.)
"""

import argparse
import json
import os
import re

import pytest

from greenroom.cli.bench import offload


def args(**kw):
    parser = argparse.ArgumentParser()
    offload.configure_parser(parser)
    ns = parser.parse_args([])
    ns.__dict__.update(kw)
    return ns


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_bench_reports_cycles_beside_its_bound_and_is_bit_exact(disk_dir, target, capsys):
    rc = offload.run(
        args(
            size=(1 << 30) // 32,
            untracked_size=(1 << 30) // 64,
            target=target,
            dir=disk_dir,
            chunk_mb=4,
            cycles=2,
            json=True,
        )
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bit_exact"] is True
    assert result["backend"] == "portable" and len(result["cycles"]) == 2
    # Each cycle is judged against a bound probed right before it; the headline is the
    # worst cycle on the disk target (its file was made and written before the first,
    # untimed), and the worst after the first on the cpu target (which pins the copies).
    for cycle in result["cycles"]:
        # The untracked 1/64 GiB moved too (bit_exact checks it came back).
        assert cycle["sleep_copied"] >= result["bytes"] == (1 << 30) // 32 + (1 << 30) // 64
        assert cycle["sleep_ratio"] > 0 and cycle["wake_ratio"] > 0 and cycle["bound"]
        # The process's CPU seconds in each phase (every thread's): a copy costs some.
        assert cycle["sleep_cpu_s"] > 0 and cycle["wake_cpu_s"] > 0
    # One more probe after the last cycle: each cycle's bracketed ratio lies between its
    # ratios against the probe before it and the one after it.
    for before, cycle in zip(result["cycles"], result["cycles"][1:]):
        assert before["bound_after"] == cycle["bound"]
    keys = ("write_bytes_per_s", "read_bytes_per_s") if target == "disk" else ("out_bytes_per_s", "in_bytes_per_s")
    for cycle in result["cycles"]:
        for phase, key in zip(("sleep", "wake"), keys):
            rate = cycle[f"{phase}_bytes_per_s"]
            ends = sorted(b[key] / rate for b in (cycle["bound"], cycle["bound_after"]))
            assert ends[0] <= cycle[f"{phase}_time_ratio_bracketed"] <= ends[1]
    steady = result["cycles"] if target == "disk" else result["cycles"][1:]
    assert result["steady_from_cycle"] == (1 if target == "disk" else 2)
    assert result["wake_time_ratio_bracketed"] == max(c["wake_time_ratio_bracketed"] for c in steady)
    assert result["sleep_time_ratio_bracketed"] == max(c["sleep_time_ratio_bracketed"] for c in steady)
    assert result["sleep_ratio"] == min(c["sleep_ratio"] for c in steady)
    assert result["wake_ratio"] == min(c["wake_ratio"] for c in steady)
    if target == "disk":
        # The offload file was made and written once before the first cycle: all of it.
        assert result["prepare_written"] >= result["bytes"] and result["prepare_s"] > 0
        assert all(c["disk_bytes_written"] <= result["prepare_written"] for c in result["cycles"])
        assert {"write_bytes_per_s", "read_bytes_per_s"} <= result["bound"].keys()
        assert all(c["stored_write_ratio"] > 0 and c["stored_read_ratio"] > 0 for c in result["cycles"])
        assert result["host_rss_budget"] is not None
    else:
        assert result["prepare_written"] == 0
        assert {"out_bytes_per_s", "in_bytes_per_s"} <= result["bound"].keys()
        assert all(c["stored_write_ratio"] is None and c["stored_read_ratio"] is None for c in result["cycles"])
    assert os.listdir(disk_dir) == []


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_the_text_report_says_what_ran_before_the_first_cycle_and_which_cycles_the_headline_covers(
    disk_dir, target, capsys
):
    rc = offload.run(args(size=(1 << 30) // 64, target=target, dir=disk_dir, chunk_mb=4, cycles=2, json=False))
    assert rc == 0
    out = capsys.readouterr().out
    if target == "disk":
        # 16.8 MB: the actor (more where the scan finds other live storages of this process).
        assert re.search(
            r"before cycle 1 \(untimed\): the offload file made and [\d.]+ MB of zeros written once in ", out
        )
        assert "worst of every cycle vs its bound" in out
    else:
        assert "before cycle 1" not in out
        assert "worst of cycles 2.. vs its bound" in out


@pytest.mark.parametrize("zero", ["0", "0B", "0GiB", "0.0"])
def test_untracked_size_takes_zero_in_any_unit(zero):
    # Any zero, not only a bare "0": "0GiB" is no "must be a positive size", the default being 0.
    parser = argparse.ArgumentParser()
    offload.configure_parser(parser)
    assert parser.parse_args(["--untracked-size", zero]).untracked_size == 0
    assert parser.parse_args(["--untracked-size", "1MiB"]).untracked_size == 1 << 20


def test_negative_untracked_size_is_a_one_line_error():
    with pytest.raises(ValueError, match="--untracked-size"):
        offload.run(args(untracked_size=-1))


def test_disk_target_without_a_dir_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    with pytest.raises(ValueError, match="needs --offload-train-disk-dir DIR"):
        offload.run(args(target="disk", dir=None))
