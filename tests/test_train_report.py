"""``greenroom report``: a metrics file from a real ``greenroom train`` run becomes a PNG."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime")}
    return subprocess.run([sys.executable, "-m", "greenroom.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_report_draws_a_png_from_a_train_run(disk_dir):
    metrics = os.path.join(disk_dir, "m.jsonl")
    run = cli("train", "--iterations", "2", "--prompts", "4", "--group-size", "2", "--minibatches", "1",
              "--offload-train", "--offload-train-target", "disk", "--offload-train-disk-dir",
              os.path.join(disk_dir, "o"), "--metrics", metrics, "--no-progress")
    assert run.returncode == 0, run.stderr
    result = cli("report", metrics, "-o", os.path.join(disk_dir, "r.png"))
    assert result.returncode == 0, result.stderr
    assert "2 iterations" in result.stdout
    with open(os.path.join(disk_dir, "r.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_file_that_is_not_metrics_is_one_line_exit_2(disk_dir):
    bad = os.path.join(disk_dir, "bad.jsonl")
    with open(bad, "w") as f:
        f.write('{"reward": 1}\n')
    result = cli("report", bad)
    assert result.returncode == 2
    assert result.stderr.strip() == f"greenroom report: error: {bad}:1: not a greenroom train metrics line"
    assert not os.path.exists(os.path.join(disk_dir, "bad.png"))
    missing = cli("report", os.path.join(disk_dir, "none.jsonl"))
    assert missing.returncode == 2 and "no such metrics file" in missing.stderr


def test_a_resumed_run_continues_the_clock_and_marks_its_segments(disk_dir):
    from greenroom.train import report

    metrics = os.path.join(disk_dir, "m.jsonl")
    small = ["--prompts", "4", "--group-size", "2", "--minibatches", "1", "--d-model", "32", "--no-progress",
             "--offload-train", "--offload-train-target", "disk", "--stream-optimizer-state-to-disk",
             "--offload-train-disk-dir", os.path.join(disk_dir, "o"), "--metrics", metrics]
    save = os.path.join(disk_dir, "ckpt")
    assert cli("train", *small, "--iterations", "2", "--save", save).returncode == 0
    resumed = cli("train", *small, "--iterations", "4", "--load", save)
    assert resumed.returncode == 0, resumed.stderr
    records = report.read_records(metrics)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    # The second process's clock starts at 0 again: it is moved to after the first's end.
    assert [first for first, _ in report.segments(records)] == [0, 2]
    times = [e[k] for r in report.continued(records) for e in r["events"] for k in ("start", "end")]
    assert times == sorted(times)
    assert all(r["stream_gbps"] > 0 and r["sleep_gbps"] > 0 for r in records)  # the bandwidth panel's points
    result = cli("report", metrics)
    assert result.returncode == 0, result.stderr
    assert "4 iterations, 2 run segments" in result.stdout
    summary = json.loads(cli("report", metrics, "--json").stdout)
    assert [s["first_iteration"] for s in summary["segments"]] == [1, 3] and summary["iterations"] == 4
