"""``greenroom report``: a metrics file from a real ``greenroom train`` run becomes a PNG."""

import json
import os

from tests.cli_support import greenroom_forked

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args):
    """``greenroom args`` in a process forked from a Python that has imported torch already."""
    return greenroom_forked(*args, env={"PYTHONPATH": os.path.join(REPO, "runtime")}, timeout=300)


def test_report_draws_a_png_from_a_train_run(disk_dir):
    metrics = os.path.join(disk_dir, "m.jsonl")
    run = cli(
        "train",
        "--iterations",
        "2",
        "--prompts",
        "4",
        "--group-size",
        "2",
        "--minibatches",
        "1",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "o"),
        "--metrics",
        metrics,
        "--no-progress",
    )
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
    from greenroom.cli import report

    metrics = os.path.join(disk_dir, "m.jsonl")
    small = [
        "--prompts",
        "4",
        "--group-size",
        "2",
        "--minibatches",
        "1",
        "--d-model",
        "32",
        "--no-progress",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "o"),
        "--metrics",
        metrics,
    ]
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


SMALL = ["--prompts", "4", "--group-size", "2", "--minibatches", "1", "--d-model", "16", "--no-progress"]


def lines_of(path):
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def one_error_line(result):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


def test_a_torn_last_line_is_left_out_and_a_resume_replaces_the_iterations_it_trained_again(disk_dir):
    """A killed run's file (its last line torn) is drawn without that line, not refused
    whole; a file of a run resumed from an earlier checkpoint than its last record (written
    by a train that kept those, or by hand) draws iteration 3 once and counts 3 iterations."""
    first, second = os.path.join(disk_dir, "a.jsonl"), os.path.join(disk_dir, "b.jsonl")
    ck = os.path.join(disk_dir, "ck")
    assert cli("train", *SMALL, "--iterations", "2", "--save", ck, "--metrics", first).returncode == 0
    assert cli("train", *SMALL, "--iterations", "3", "--load", ck, "--metrics", second).returncode == 0
    a, [b] = lines_of(first), lines_of(second)
    torn = os.path.join(disk_dir, "torn.jsonl")
    with open(torn, "w") as f:
        f.writelines([*a, b[:40]])
    result = cli("report", torn, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["iterations"] == 2
    assert f"{torn}:3: left out a torn last line" in result.stderr
    overlap = os.path.join(disk_dir, "overlap.jsonl")
    again = json.loads(b)
    again["reward"] = 0.75
    with open(overlap, "w") as f:
        f.writelines([*a, b, json.dumps(again) + "\n"])  # killed after logging 3, resumed from the checkpoint at 2
    result = cli("report", overlap, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["iterations"] == 3 and [s["first_iteration"] for s in summary["segments"]] == [1, 3]
    assert f"{overlap}:4: a resumed run trained iterations 3-3 again: drew its records" in result.stderr
    from greenroom.cli import report

    assert [r["reward"] for r in report.read_records(overlap)][2] == 0.75


def test_what_is_not_one_runs_metrics_is_one_line_and_no_png(disk_dir):
    """A dir (IsADirectoryError traceback), bytes that are not UTF-8 (a line naming no
    file), a record without events or keys draw reads (KeyError/IndexError tracebacks),
    and two runs in one file (drawn as one run "resumed at iteration 1")."""
    metrics = os.path.join(disk_dir, "m.jsonl")
    assert cli("train", *SMALL, "--iterations", "2", "--metrics", metrics).returncode == 0
    record = json.loads(lines_of(metrics)[0])
    cases = {
        "adir": None,
        "binary.jsonl": b"\xff\xfe\x00\x01",
        "no-events.jsonl": json.dumps(dict(record, events=[])).encode() + b"\n",
        "no-device.jsonl": json.dumps({k: v for k, v in record.items() if k != "device"}).encode() + b"\n",
        "two-runs.jsonl": b"".join(line.encode() for line in lines_of(metrics) * 2),
    }
    expected = {
        "adir": "adir: cannot read it (Is a directory)",
        "binary.jsonl": "binary.jsonl: not a greenroom train metrics file (not UTF-8 text)",
        "no-events.jsonl": "no-events.jsonl:1: not a greenroom train metrics line",
        "no-device.jsonl": "no-device.jsonl:1: not a greenroom train metrics line",
        "two-runs.jsonl": "two-runs.jsonl:3: a new run starts at iteration 1 after iteration 2 (line 2)",
    }
    for name, data in cases.items():
        path = os.path.join(disk_dir, name)
        if data is None:
            os.makedirs(path)
        else:
            with open(path, "wb") as f:
                f.write(data)
        before = sorted(os.listdir(disk_dir))
        line = one_error_line(cli("report", path))
        assert line.startswith("greenroom report: error: ") and expected[name] in line, line
        assert sorted(os.listdir(disk_dir)) == before


def test_the_output_never_replaces_a_file_report_did_not_draw(disk_dir):
    """-o is not written whatever it names: the metrics file itself, a user's file (or, for
    a name matplotlib has no format for, a traceback), a path it cannot write (a
    FileNotFoundError traceback), a dir (writing DIR.png and saying "wrote DIR")."""
    metrics = os.path.join(disk_dir, "m.jsonl")
    assert cli("train", *SMALL, "--iterations", "1", "--metrics", metrics).returncode == 0
    mine = os.path.join(disk_dir, "mine.png")
    with open(mine, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n a photo")
    os.makedirs(os.path.join(disk_dir, "adir"))
    kept = {p: open(p, "rb").read() for p in (metrics, mine)}
    cases = {
        metrics: "greenroom report writes a PNG; give a path ending in .png",
        mine: "exists and is not a plot greenroom report drew; refusing to overwrite it",
        os.path.join(disk_dir, "adir"): "greenroom report writes a PNG",
        os.path.join(disk_dir, "adir.png", "x.png"): "cannot write it (No such file or directory)",
        "/proc/greenroom-report.png": "cannot write it",
    }
    for output, expected in cases.items():
        before = sorted(os.listdir(disk_dir))
        line = one_error_line(cli("report", metrics, "-o", output))
        assert line.startswith(f"greenroom report: error: -o {output}") and expected in line, line
        assert sorted(os.listdir(disk_dir)) == before
    assert kept == {p: open(p, "rb").read() for p in kept}
    png = os.path.join(disk_dir, "r.png")
    for _ in range(2):  # a plot of its own is replaced
        result = cli("report", metrics, "-o", png)
        assert result.returncode == 0 and result.stdout.startswith(f"wrote {png} ("), result.stderr
    assert sorted(os.listdir(disk_dir)) == ["adir", "m.jsonl", "mine.png", "r.png"]
