"""The bad-input sweep: every case exits 2 with one error line naming what is wrong, no
traceback, and leaves the disk as it was.

Most cases call the CLI's ``main`` in this process (a fresh interpreter per case costs
seconds of torch import); an exception escaping it fails the test, so "no traceback"
holds. A few run as real processes to show the same from outside. Tests run as root
here, so "a dir nobody can write" is one under /proc, which root cannot write either.
"""

import os

import pytest

from greenroom.cli import main as cli
from tests.cli_support import greenroom, one_line_error

SMALL = [
    "--iterations",
    "1",
    "--prompts",
    "4",
    "--group-size",
    "2",
    "--minibatches",
    "1",
    "--d-model",
    "16",
    "--no-progress",
]
DISK = ["--offload-train", "--offload-train-target", "disk"]
STREAM = ["--stream-optimizer-state-to-disk", "--offload-train-disk-dir"]
PLAN = ["--params", "1e6"]


def PLAN_STREAM(sandbox):
    return [*PLAN, *STREAM, os.path.join(sandbox, "off")]


@pytest.fixture
def sandbox(disk_dir):
    """A dir with a file, a non-empty dir and a YAML or two to point bad inputs at."""
    os.makedirs(os.path.join(disk_dir, "adir"))
    with open(os.path.join(disk_dir, "adir", "precious"), "w") as f:
        f.write("user data")
    with open(os.path.join(disk_dir, "afile"), "w") as f:
        f.write("a file")
    files = {
        "broken.yaml": b"job: [unclosed\n",
        "binary.yaml": b"\xff\xfe\x00\x01\x89PNG",
        "empty.yaml": b"",
        "unknown.yaml": b"job_name: x\nno_such_key: 1\n",
        "list.yaml": b"- a\n- b\n",
    }
    for name, data in files.items():
        with open(os.path.join(disk_dir, name), "wb") as f:
            f.write(data)
    return disk_dir


def snapshot(root):
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path) if os.path.isfile(path) else None
    return out


def S(sandbox, *parts):
    return os.path.join(sandbox, *parts)


# name -> (argv builder, env, text the one error line must contain)
CASES = {
    # train
    "train --iterations -1": (lambda s: ["train", *SMALL, "--iterations", "-1"], {}, "--iterations must be a positive"),
    # A model or batch past the RAM (not a C++ allocation dump, nor building layers until the OOM killer comes).
    # The launcher's variables (not int()'s bare "invalid literal"; a negative rank must not make a dir rank-0001).
    "$RANK=-1": (lambda s: ["train", *SMALL], {"RANK": "-1"}, "$RANK='-1' is not a whole number from 0"),
    "$RANK=abc": (lambda s: ["train", *SMALL], {"RANK": "abc"}, "$RANK='abc' is not a whole number from 0"),
    "$WORLD_SIZE=0": (lambda s: ["train", *SMALL], {"WORLD_SIZE": "0"}, "$WORLD_SIZE='0' is not a whole number from 1"),
    "train --n-layers huge": (
        lambda s: ["train", *SMALL, "--device", "cpu", "--n-layers", "10000000000"],
        {},
        "of host memory per rank (the weights, their grads and one rollout's keys",
    ),
    "train --digits huge": (
        lambda s: ["train", *SMALL, "--device", "cpu", "--digits", "100000000000"],
        {},
        "(sequences of 200000000002 tokens): that needs",
    ),
    "train --save-interval -1": (
        lambda s: ["train", *SMALL, "--save", f"{s}/ck", "--save-interval", "-1"],
        {},
        "--save-interval must be a whole number of iterations >= 0",
    ),
    "train --keep-last 0": (
        lambda s: ["train", *SMALL, "--save", f"{s}/ck", "--keep-last", "0"],
        {},
        "--keep-last must be a whole number of checkpoints >= 1",
    ),
    "train --async-save without --save": (
        lambda s: ["train", *SMALL, "--async-save"],
        {},
        "--async-save needs --save DIR",
    ),
    "train --iterations abc": (lambda s: ["train", "--iterations", "abc"], {}, "--iterations: invalid int value"),
    "train --lr -1": (lambda s: ["train", *SMALL, "--lr", "-1"], {}, "--lr must be positive"),
    # unchecked, these train: on NaN weights after the first step (--group-size 1 then fails
    # in a traceback from torch.multinomial), or a loss of nan; a 20-digit --seed is torch's
    # "Overflow when unpacking long long"
    "train --lr inf": (lambda s: ["train", *SMALL, "--lr", "inf"], {}, "--lr must be positive and finite, got inf"),
    "train --group-size 1": (
        lambda s: ["train", *SMALL, "--group-size", "1"],
        {},
        "--group-size 1: each prompt needs at least 2 completions",
    ),
    "train --kl-coef nan": (
        lambda s: ["train", *SMALL, "--reference-policy", "--kl-coef", "nan"],
        {},
        "--kl-coef must be a finite number >= 0, got nan",
    ),
    "train --kl-coef -1": (
        lambda s: ["train", *SMALL, "--reference-policy", "--kl-coef=-1"],
        {},
        "--kl-coef must be a finite number >= 0, got -1.0",
    ),
    "train --kl-coef without --reference-policy": (
        lambda s: ["train", *SMALL, "--kl-coef", "0.1"],
        {},
        "--kl-coef 0.1 weighs the KL penalty towards --reference-policy",
    ),
    "train --weight-decay inf": (
        lambda s: ["train", *SMALL, "--weight-decay", "inf"],
        {},
        "--weight-decay must be a finite number >= 0, got inf",
    ),
    "train --seed 20 digits": (
        lambda s: ["train", *SMALL, "--seed", "9" * 20],
        {},
        "--seed must be a whole number from 0 to 4294967295",
    ),
    "train --minibatches 3 (does not divide)": (
        lambda s: ["train", *SMALL, "--minibatches", "3"],
        {},
        "--minibatches 3 must divide",
    ),
    "train huge chunk": (
        lambda s: [
            "train",
            *SMALL,
            *DISK,
            "--offload-train-disk-dir",
            S(s, "off"),
            "--offload-train-disk-chunk-mb",
            "10000000",
        ],
        {},
        "host memory per rank",
    ),
    "train chunk 0": (
        lambda s: [
            "train",
            *SMALL,
            *DISK,
            "--offload-train-disk-dir",
            S(s, "off"),
            "--offload-train-disk-chunk-mb",
            "0",
        ],
        {},
        "--offload-train-disk-chunk-mb must be",
    ),
    "train disk dir is a file": (
        lambda s: ["train", *SMALL, *DISK, "--offload-train-disk-dir", S(s, "afile")],
        {},
        "is a file, not a directory",
    ),
    "train disk dir under a file": (
        lambda s: ["train", *SMALL, *DISK, "--offload-train-disk-dir", S(s, "afile", "sub")],
        {},
        "is a file, not a directory",
    ),
    "train disk dir not writable": (
        lambda s: ["train", *SMALL, *DISK, "--offload-train-disk-dir", "/proc/greenroom-test"],
        {},
        "takes no new directory",
    ),
    "train --save is a file": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--save", S(s, "afile")],
        {},
        "is not a directory",
    ),
    "train --save under a file": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--save", S(s, "afile", "ckpt")],
        {},
        "is not a directory",
    ),
    "train --save not writable": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--save", "/proc/greenroom-ckpt"],
        {},
        "cannot create files there",
    ),
    "train --save over a user's dir": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--save", S(s, "adir")],
        {},
        "refusing to write there",
    ),
    "train --load missing": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--load", S(s, "nope")],
        {},
        "no such checkpoint dir",
    ),
    "train --load a file": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--load", S(s, "afile")],
        {},
        "is not a directory",
    ),
    "train --load a non-checkpoint dir": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "m.jsonl"), "--load", S(s, "adir")],
        {},
        "generation.json",
    ),
    "train --metrics under /proc": (
        lambda s: ["train", *SMALL, "--metrics", "/proc/greenroom.jsonl"],
        {},
        "cannot create files there",
    ),
    "train --metrics is a dir": (lambda s: ["train", *SMALL, "--metrics", S(s, "adir")], {}, "is a directory"),
    "train --metrics under a file": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "afile", "m.jsonl")],
        {},
        "is not a directory",
    ),
    # not truncated by a fresh run (nor every line that is not JSON dropped by a resumed one)
    "train --metrics a user's file": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "afile")],
        {},
        "line 1 is not a greenroom train metrics record, so greenroom did not write",
    ),
    "train --metrics another tool's JSON lines": (
        lambda s: ["train", *SMALL, "--metrics", S(s, "list.yaml")],
        {},
        "refusing to overwrite it",
    ),
    "train job id with a slash": (
        lambda s: ["train", *SMALL, *DISK, "--metrics", S(s, "m.jsonl"), "--offload-train-disk-dir", S(s, "off")],
        {"GREENROOM_JOB_ID": "a/b"},
        "the job id (from $GREENROOM_JOB_ID",
    ),
    # plan
    "plan --world-size 0": (
        lambda s: ["plan", "--params", "7B", "--world-size", "0"],
        {},
        "--world-size: must be a positive integer",
    ),
    "plan --params -5": (lambda s: ["plan", "--params", "-5"], {}, "--params: '-5': must be a positive count"),
    # a number past a float's range is too large, not "must be a positive count"
    "plan --params 1e400": (
        lambda s: ["plan", "--params", "1e400"],
        {},
        "--params: '1e400' is too large to be a count (e.g. 7B",
    ),
    "bench disk --size 1e308TiB": (
        lambda s: ["bench", "disk", s, "--size", "1e308TiB"],
        {},
        "--size: '1e308TiB' is too large to be a size",
    ),
    "plan --params abc": (lambda s: ["plan", "--params", "abc"], {}, "--params: 'abc' is not a count"),
    "plan --params 7X": (lambda s: ["plan", "--params", "7X"], {}, "--params: '7X' is not a count"),
    "plan no --params": (lambda s: ["plan"], {}, "required: --params"),
    "plan --data-parallel 3 of 8": (
        lambda s: ["plan", "--params", "7B", "--world-size", "8", "--data-parallel", "3"],
        {},
        "--data-parallel 3 must divide --world-size 8",
    ),
    "plan --nproc-per-node 3 of 8": (
        lambda s: ["plan", "--params", "7B", "--world-size", "8", "--nproc-per-node", "3"],
        {},
        "--nproc-per-node 3 must divide --world-size 8",
    ),
    "plan --gpu-memory-gb -1": (
        lambda s: ["plan", "--params", "7B", "--gpu-memory-gb=-1"],
        {},
        "--gpu-memory-gb: must be a positive number",
    ),
    "plan --sharding zero9": (lambda s: ["plan", "--params", "7B", "--sharding", "zero9"], {}, "invalid choice"),
    "plan read GB/s alone": (
        lambda s: ["plan", "--params", "7B", "--disk-read-gbps", "3"],
        {},
        "--disk-read-gbps and --disk-write-gbps go together",
    ),
    # the seconds would be inf (printed "inf s", and Infinity in --json, which is not JSON)
    "plan --disk-read-gbps 5e-324": (
        lambda s: ["plan", *PLAN_STREAM(s), "--disk-read-gbps", "5e-324", "--disk-write-gbps", "1", "--json"],
        {},
        "--disk-read-gbps: 5e-324 GB/s: expected 1e-06 (1 KB/s) to 1e+06 (1 PB/s)",
    ),
    "plan --disk-write-gbps 1e308": (
        lambda s: ["plan", *PLAN_STREAM(s), "--disk-read-gbps", "1", "--disk-write-gbps", "1e308", "--json"],
        {},
        "--disk-write-gbps: 1e308 GB/s: expected",
    ),
    "plan --measure-disk without a dir": (
        lambda s: ["plan", "--params", "7B", "--measure-disk"],
        {},
        "--measure-disk needs an existing --offload-train-disk-dir",
    ),
    "plan disk dir is a file": (
        lambda s: ["plan", "--params", "1e6", *DISK, "--offload-train-disk-dir", S(s, "afile")],
        {},
        "is a file, not a directory",
    ),
    "plan unknown target": (
        lambda s: ["plan", "--params", "1e6", "--offload-train-target", "nvme"],
        {},
        "invalid choice",
    ),
    "plan host cache -1": (
        lambda s: ["plan", *PLAN_STREAM(s), "--stream-optimizer-state-host-cache-gb=-1"],
        {},
        "--stream-optimizer-state-host-cache-gb must be a finite number of GB >= 0",
    ),
    "plan host cache nan": (
        lambda s: ["plan", *PLAN_STREAM(s), "--stream-optimizer-state-host-cache-gb", "nan"],
        {},
        "--stream-optimizer-state-host-cache-gb must be a finite number of GB >= 0",
    ),
    # huge finite sizes, not OverflowError tracebacks (GB times 1e9 is inf)
    "plan --gpu-memory-gb 1e308": (
        lambda s: ["plan", *PLAN, "--gpu-memory-gb", "1e308"],
        {},
        "--gpu-memory-gb: 1e308 GB is more than an exabyte",
    ),
    "plan --host-memory-gb 1e308": (
        lambda s: ["plan", *PLAN, "--host-memory-gb", "1e308"],
        {},
        "--host-memory-gb: 1e308 GB is more than an exabyte",
    ),
    "plan host cache 1e300": (
        lambda s: ["plan", *PLAN_STREAM(s), "--stream-optimizer-state-host-cache-gb", "1e300"],
        {},
        "and at most 1e+09 (an exabyte)",
    ),
    "train host cache 1e300": (
        lambda s: ["train", *SMALL, *STREAM, S(s, "off"), "--stream-optimizer-state-host-cache-gb", "1e300"],
        {},
        "and at most 1e+09 (an exabyte)",
    ),
    # past an exabyte of params or 2**31 ranks the byte figures overflowed: OverflowError tracebacks
    "plan --params 1e308": (
        lambda s: ["plan", "--params", "1e308"],
        {},
        "--params 100000... (309 digits): expected 1 to 1e+18",
    ),
    "plan --world-size 400 digits": (
        lambda s: ["plan", *PLAN, "--world-size", "9" * 400],
        {},
        "--world-size must be a positive integer of at most 2147483647",
    ),
    "plan host cache abc": (
        lambda s: ["plan", *PLAN_STREAM(s), "--stream-optimizer-state-host-cache-gb", "abc"],
        {},
        "--stream-optimizer-state-host-cache-gb: invalid float value",
    ),
    "plan host cache huge": (
        lambda s: ["plan", *PLAN_STREAM(s), "--stream-optimizer-state-host-cache-gb", "1e9"],
        {},
        "(the host cache plus the pinned staging)",
    ),
    "plan host cache without streaming": (
        lambda s: ["plan", *PLAN, "--stream-optimizer-state-host-cache-gb", "2"],
        {},
        "needs --stream-optimizer-state-to-disk",
    ),
    "train host cache inf": (
        lambda s: ["train", *SMALL, *STREAM, S(s, "off"), "--stream-optimizer-state-host-cache-gb", "inf"],
        {},
        "--stream-optimizer-state-host-cache-gb must be a finite number",
    ),
    # doctor
    "doctor --chunk-mb -5": (
        lambda s: ["doctor", s, "--chunk-mb", "-5", "--no-probe"],
        {},
        "--offload-train-disk-chunk-mb must be a positive",
    ),
    "doctor --chunk-mb huge": (
        lambda s: ["doctor", s, "--chunk-mb", "10000000", "--no-probe"],
        {},
        "of host memory per rank",
    ),
    "doctor DIR missing": (lambda s: ["doctor", S(s, "nope"), "--no-probe"], {}, "is not a directory"),
    "doctor DIR is a file": (lambda s: ["doctor", S(s, "afile"), "--no-probe"], {}, "is not a directory"),
    # reclaim
    "reclaim ROOT missing": (lambda s: ["reclaim", S(s, "nope")], {}, "does not exist"),
    "reclaim ROOT is a file": (lambda s: ["reclaim", S(s, "afile")], {}, "is not a directory"),
    "reclaim --min-age nan": (lambda s: ["reclaim", s, "--min-age", "nan"], {}, "finite number of seconds"),
    "reclaim --min-age -1": (lambda s: ["reclaim", s, "--min-age=-1"], {}, "finite number of seconds"),
    "reclaim --min-age abc": (lambda s: ["reclaim", s, "--min-age", "abc"], {}, "--min-age: invalid float value"),
    # a nan interval would be a loop without a pause, inf or 1e300 an OverflowError traceback
    "reclaim --kubernetes --interval nan": (
        lambda s: ["reclaim", s, "--kubernetes", "--node-name", "n1", "--interval", "nan"],
        {},
        "--interval must be more than 0",
    ),
    "reclaim --kubernetes --interval 1e300": (
        lambda s: ["reclaim", s, "--kubernetes", "--node-name", "n1", "--interval", "1e300"],
        {},
        "at most 86400 seconds",
    ),
    "reclaim --kubernetes --min-age nan": (
        lambda s: ["reclaim", s, "--kubernetes", "--node-name", "n1", "--min-age", "nan"],
        {},
        "finite number of seconds",
    ),
    # bench
    "bench disk DIR missing": (lambda s: ["bench", "disk", S(s, "nope")], {}, "is not a directory"),
    "bench disk --chunk-mb 0": (lambda s: ["bench", "disk", s, "--chunk-mb", "0"], {}, "must be positive"),
    "bench disk --chunk-mb huge": (
        lambda s: ["bench", "disk", s, "--chunk-mb", "10000000", "--size", "1MiB"],
        {},
        "of host memory per rank",
    ),
    "bench stream --chunk-mb huge": (
        lambda s: ["bench", "stream", "--params", "1000", "--dir", s, "--chunk-mb", "10000000"],
        {},
        "of host memory per rank",
    ),
    "bench stream --params -1": (
        lambda s: ["bench", "stream", "--params", "-1", "--dir", s],
        {},
        "--params: '-1': must be a positive count",
    ),
    "bench stream --dir a file": (
        lambda s: ["bench", "stream", "--params", "1000", "--dir", S(s, "afile")],
        {},
        "is not a directory",
    ),
    "bench stream host cache -1": (
        lambda s: ["bench", "stream", "--params", "1000", "--dir", s, "--stream-optimizer-state-host-cache-gb=-1"],
        {},
        "--stream-optimizer-state-host-cache-gb must be a finite number of GB >= 0",
    ),
    "bench stream host cache huge": (
        lambda s: ["bench", "stream", "--params", "1000", "--dir", s, "--stream-optimizer-state-host-cache-gb", "1e9"],
        {},
        "of host memory per rank",
    ),
    "bench offload --size -1": (
        lambda s: ["bench", "offload", "--size", "-1", "--dir", s],
        {},
        "--size: '-1': must be a positive size",
    ),
    "bench disk --repeat 0": (lambda s: ["bench", "disk", s, "--repeat", "0"], {}, "--repeat: must be a positive"),
    # Sizes past the disk, the RAM or the staging: refused before a byte is allocated or written
    # (they died in posix_fallocate, or allocated until the OOM killer came).
    "bench disk --size past the disk": (
        lambda s: ["bench", "disk", s, "--size", "1000000TiB"],
        {},
        "bench disk --size 976.6 PiB: that needs",
    ),
    "bench disk --size past a C long": (
        lambda s: ["bench", "disk", s, "--size", "99999999999999999999999"],
        {},
        "which has",
    ),
    "bench disk --depth past the chunk": (
        lambda s: ["bench", "disk", s, "--size", "1MiB", "--chunk-mb", "8", "--depth", "9", "--compression", "zstd"],
        {},
        "bench disk --depth 9: use at most 8",
    ),
    "bench disk --depth past 64": (
        lambda s: ["bench", "disk", s, "--size", "1MiB", "--depth", "65"],
        {},
        "bench disk --depth 65: use at most 64",
    ),
    "bench disk --device a number": (
        lambda s: ["bench", "disk", s, "--device", "0"],
        {},
        "argument --device: invalid choice",
    ),
    "bench offload --size past the disk": (
        lambda s: ["bench", "offload", "--size", "1000000TiB", "--dir", s],
        {},
        "bench offload --size 976.6 PiB",
    ),
    "bench offload --size past the RAM": (
        lambda s: ["bench", "offload", "--size", "1000000TiB", "--target", "cpu"],
        {},
        "of host memory per rank",
    ),
    "bench stream --params past the RAM": (
        lambda s: ["bench", "stream", "--params", "1e18", "--dir", s, "--device", "cpu"],
        {},
        "bench stream --params 1000000000000000000",
    ),
    "bench codec --size past the RAM": (
        lambda s: ["bench", "codec", "--compression", "zstd", "--size", "1000000TiB"],
        {},
        "bench codec --size 976.6 PiB: that needs",
    ),
    "bench codec --threads past 128": (
        lambda s: ["bench", "codec", "--compression", "zstd", "--threads", "129"],
        {},
        "bench codec --threads: expected 1 to 128",
    ),
    "bench stream --raw-size past the disk": (
        lambda s: ["bench", "stream", "--params", "1000", "--dir", s, "--raw-size", "1000000TiB"],
        {},
        "(+ --raw-size 976.6 PiB)",
    ),
    # a missing --dir is not made (parents too) and left behind after the bench
    "bench offload --dir missing": (
        lambda s: ["bench", "offload", "--size", "1MiB", "--dir", S(s, "nope", "sub")],
        {},
        "bench offload --offload-train-disk-dir",
    ),
    "bench codec --dir missing": (
        lambda s: [
            "bench",
            "codec",
            "--compression",
            "zstd",
            "--size",
            "1",
            "--state",
            "random",
            "--dir",
            S(s, "nope"),
        ],
        {},
        "bench codec --dir",
    ),
    "bench disk no DIR": (lambda s: ["bench", "disk"], {}, "give the dir: --offload-train-disk-dir DIR"),
    "bench disk two dirs": (
        lambda s: ["bench", "disk", s, "--offload-train-disk-dir", S(s, "adir")],
        {},
        "differ: give one",
    ),
    # slurm render
    "slurm render missing config": (lambda s: ["slurm", "render", S(s, "nope.yaml")], {}, "no such config file"),
    "slurm render malformed YAML": (lambda s: ["slurm", "render", S(s, "broken.yaml")], {}, "not valid YAML"),
    "slurm render binary file": (lambda s: ["slurm", "render", S(s, "binary.yaml")], {}, "binary.yaml: not UTF-8"),
    "slurm render empty file": (lambda s: ["slurm", "render", S(s, "empty.yaml")], {}, "the file is empty"),
    "slurm render unknown key": (lambda s: ["slurm", "render", S(s, "unknown.yaml")], {}, "no_such_key"),
    "slurm render a list": (lambda s: ["slurm", "render", S(s, "list.yaml")], {}, "expected a mapping"),
    "slurm render config is a dir": (lambda s: ["slurm", "render", S(s, "adir")], {}, "cannot read it"),
    "slurm render -o under a file": (
        lambda s: ["slurm", "render", os.path.join(REPO_EXAMPLES, "single-node.yaml"), "-o", S(s, "afile", "job.sh")],
        {},
        "-o ",
    ),
}
REPO_EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "deploy", "slurm", "examples"
)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(sandbox, name, capsys, monkeypatch):
    build, env, expected = CASES[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(sandbox)  # the default --metrics is relative: it would land here
    before = snapshot(sandbox)
    try:
        rc = cli.main(build(sandbox))
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert expected in lines[0], lines[0]
    assert snapshot(sandbox) == before


@pytest.mark.parametrize(
    "command",
    [
        ["bench", "disk", "{s}", "--size", "1MiB"],
        ["bench", "stream", "--params", "1000", "--dir", "{s}"],
        ["bench", "offload", "--size", "1MiB", "--dir", "{s}"],
    ],
)
def test_device_cuda_without_cuda_is_one_line(sandbox, command, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is up here: --device cuda is fine")
    before = snapshot(sandbox)
    assert cli.main([a.format(s=sandbox) for a in command] + ["--device", "cuda"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--device cuda: no CUDA device is available; use --device cpu" in line
    assert snapshot(sandbox) == before


@pytest.mark.parametrize(
    "args",
    [
        [
            "train",
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-chunk-mb",
            "10000000",
            "--offload-train-disk-dir",
            "{s}/off",
        ],
        ["train", "--save", "{s}/afile"],
        ["reclaim", "{s}/nope"],
    ],
)
def test_as_a_real_process_no_traceback(sandbox, args):
    before = snapshot(sandbox)
    one_line_error(greenroom(*[a.format(s=sandbox) for a in args], cwd=sandbox))
    assert snapshot(sandbox) == before
