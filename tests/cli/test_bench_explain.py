"""Where a bench's time went (``greenroom.cli.bench.explain``, ``greenroom.io.timeline``):
``bench stream`` and ``bench offload`` carry a breakdown per step, sleep and wake, and a
phase over its stored-bytes bound names the largest share of the disk's idle time."""

import json
import time

from greenroom.cli import main as cli
from greenroom.io.compression import ZstdPlanes
from tests.cli_support import greenroom

STREAM = [
    "bench",
    "stream",
    "--params",
    "2e6",
    "--bucket-numel",
    "500000",
    "--param-numel",
    "450000",
    "--chunk-mb",
    "8",
    "--raw-size",
    "128MiB",  # two probe blocks: the mixed probe, so the overlapped bound, needs them
    "--steps",
    "2",
    "--io-only",
]
PARTS = ("codec", "device_copy", "host", "sync", "other")


def _check_breakdown(b: dict) -> None:
    assert b["wall_s"] > 0
    for key in ("disk_busy_fraction", "disk_idle_fraction"):
        assert 0 <= b[key] <= 1
    assert b["disk_busy_s"] > 0  # every phase here reads or writes
    assert set(b["parts"]) == set(PARTS)
    for part in b["parts"].values():
        assert 0 <= part["idle_fraction"] <= 1 and part["idle_s"] >= 0
    # The parts of the disk's idle time are exclusive and make it up (Note [where the time went]).
    assert abs(sum(p["idle_s"] for p in b["parts"].values()) - b["disk_idle_s"]) < 1e-9
    assert abs(b["disk_busy_s"] + b["disk_idle_s"] - b["wall_s"]) < 1e-9
    assert b["largest"] is None or b["largest"] in PARTS
    assert b["disk_depth"] >= 1


def _breakdown(wall: float, busy: float, depth: float, idle_parts: dict) -> dict:
    parts = {k: {"idle_s": idle_parts.get(k, 0.0), "idle_fraction": idle_parts.get(k, 0.0) / wall} for k in PARTS}
    largest = max(parts, key=lambda k: parts[k]["idle_s"]) if wall > busy else None
    return {
        "wall_s": wall,
        "disk_busy_fraction": busy / wall,
        "disk_idle_fraction": (wall - busy) / wall,
        "disk_depth": depth,
        "parts": parts,
        "largest": largest,
    }


def test_a_phase_the_disk_filled_but_slowly_says_the_disk_itself_was_slow_with_its_depth():
    from greenroom.cli.bench.explain import explanation

    # 1.25x over: the bound is 80% of the time, the disk was busy 99% (19% beyond it) and idled 1%.
    line = explanation("step 1", _breakdown(4.0, 3.96, 1.7, {"other": 0.04}), 1.25, "the bound")
    assert line.startswith("step 1 took 1.25x the bound: the disk was busy 99% of it with 1.7 requests in flight")
    assert "(the raw probe keeps 4): the disk itself ran below the probe's rate, busy 19% of the time beyond" in line
    # Never busy an instant less: still a line, no largest share to name.
    full = explanation("wake 2", _breakdown(4.0, 4.0, 2.0, {}), 1.10, "the bound")
    assert "the disk itself ran below the probe's rate" in full
    # Idle longer than busy beyond the bound: the largest share of the idle time is named.
    idle = explanation("step 2", _breakdown(4.0, 2.0, 1.0, {"codec": 1.5, "other": 0.5}), 1.25, "the bound")
    assert "the largest share of the rest was the codec, 38% of the time" in idle


def test_bench_stream_json_carries_each_steps_breakdown(disk_dir):
    r = json.loads(greenroom(*STREAM, "--dir", disk_dir, "--json", check_rc=0).stdout)
    assert len(r["steps"]) == 2
    for s in r["steps"]:
        _check_breakdown(s["breakdown"])
        assert s["breakdown"]["wall_s"] == s["seconds"]
        assert s["breakdown"]["parts"]["host"]["busy_s"] > 0  # the checksums of every chunk
        assert s["overlapped_ratio"] > 0
        assert (s["explanation"] is not None) == (s["overlapped_ratio"] > 1.05)
    assert r["steps"][-1]["overlapped_ratio"] == r["overlapped_ratio"]


def test_bench_offload_json_carries_each_sleeps_and_wakes_breakdown(disk_dir):
    r = json.loads(
        greenroom(
            "bench", "offload", "--device", "cpu", "--size", "64MiB", "--cycles", "1", "--dir", disk_dir, "--json"
        ).stdout
    )
    [c] = r["cycles"]
    for phase in ("sleep", "wake"):
        _check_breakdown(c[f"{phase}_breakdown"])
        ratio = c[f"{phase}_stored_time_ratio"]
        assert ratio > 0
        assert (c[f"{phase}_explanation"] is not None) == (ratio > 1.05)
    # The wake's seconds over the raw disk's seconds for the bytes it read.
    raw_seconds = c["disk_bytes_read"] / c["bound"]["read_bytes_per_s"]
    assert abs(c["wake_stored_time_ratio"] * raw_seconds - c["wake_s"]) < 1e-9


def test_a_step_held_off_the_disk_by_the_codec_says_so(disk_dir, monkeypatch, capsys):
    """Guards the explanation itself: with the host codec made slower than any disk (each
    frame's encode and decode sleeps 20 ms, in this process), every step misses its
    overlapped bound by far and its line names the codec as what the disk waited for."""
    encode, decode = ZstdPlanes.encode, ZstdPlanes.decode

    def slow_encode(self, *args):
        time.sleep(0.02)
        return encode(self, *args)

    def slow_decode(self, *args):
        time.sleep(0.02)
        return decode(self, *args)

    monkeypatch.setattr(ZstdPlanes, "encode", slow_encode)
    monkeypatch.setattr(ZstdPlanes, "decode", slow_decode)
    assert cli.main([*STREAM, "--dir", disk_dir, "--compression", "zstd"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  step 2 took ")]
    assert len(lines) == 1, out
    assert "x the overlapped bound of its stored bytes" in lines[0]
    assert "the largest share of the rest was the codec" in lines[0], lines[0]
