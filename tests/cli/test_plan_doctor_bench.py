"""`greenroom plan`, `doctor` and `bench disk` as a user runs them."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from tests.cli_support import greenroom, one_line_error


def test_version():
    assert greenroom("--version", check_rc=0).stdout.startswith("greenroom ")


def test_plan_reports_dirs_staging_disk_and_verdict(disk_dir):
    proc = greenroom(
        "plan",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--stream-optimizer-state-moment-dtype",
        "bf16",
        "--offload-train-disk-dir",
        disk_dir,
        "--offload-train-disk-chunk-mb",
        "128",
        "--params",
        "1e6",
        "--world-size",
        "2",
        "--role",
        "critic",
        env={"GREENROOM_JOB_ID": "job7"},
        check_rc=0,
    )
    out = proc.stdout
    assert (
        "pinned staging per rank: 268.4 MB (2 x --offload-train-disk-chunk-mb 128: offload and streaming each "
        "stage their own)"
    ) in out
    assert os.path.join(disk_dir, "job7", "critic", "rank00000") in out
    assert "verdict:    OK" in out
    assert "StreamingAdam 8 B (master + 2 moments), StreamingMuon 6 B (master + momentum)" in out
    plan = json.loads(
        greenroom(
            "plan",
            "--stream-optimizer-state-to-disk",
            "--offload-train-disk-dir",
            disk_dir,
            "--params",
            "1e6",
            "--world-size",
            "2",
            "--sharding",
            "optimizer",
            "--stream-optimizer-state-moment-dtype",
            "bf16",
            "--json",
            check_rc=0,
        ).stdout
    )
    # bf16 moments: the master as a 16-bit remainder (2.014 B) + 2 x 2 B moments, over 2 optimizer shards.
    assert plan["disk_bytes_per_rank"]["streaming"] == int(500_000 * (6 + 8 / 4096 + 12 / 1024))
    # Muon: master + one bf16 momentum; StreamingAdam's default for bf16 params: the master as a 16-bit remainder
    assert plan["streamed_bytes_per_param"] == {
        "adam": 8.0,
        "muon": 6.0,
        "adam_bf16_remainder": 6 + 8 / 4096 + 12 / 1024,
    }
    assert plan["staging_bytes_per_rank"] == 256 << 20 and plan["fits"] is True
    assert plan["master_layout"] == "remainder"


def test_plan_with_whole_masters_drops_the_remainder_figure(disk_dir):
    argv = [
        "plan",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--params",
        "1e6",
        "--stream-optimizer-state-master-layout",
        "fp32",
    ]
    plan = json.loads(greenroom(*argv, "--json", check_rc=0).stdout)
    assert plan["master_layout"] == "fp32"
    assert plan["streamed_bytes_per_param"] == {"adam": 12.0, "muon": 8.0}
    out = greenroom(*argv, check_rc=0).stdout
    assert "streaming:  on, moments fp32, masters fp32" in out and "per 16-bit param with masters whole" in out
    assert "remainder" not in out


def test_plan_reports_the_host_cache_with_the_staging(disk_dir):
    argv = [
        "plan",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--params",
        "1e8",
        "--world-size",
        "4",
        "--nproc-per-node",
        "2",
        "--sharding",
        "optimizer",
        "--stream-optimizer-state-master-layout",
        "fp32",
    ]
    off = json.loads(greenroom(*argv, "--json", check_rc=0).stdout)
    assert off["host_cache_bytes_per_rank"] == 0 and off["host_bytes_per_rank"] == 256 << 20
    assert "host cache" not in greenroom(*argv, check_rc=0).stdout
    # 0.3 GB per rank of a 0.3 GB streamed shard (12 B x 1e8 / 4): all of it; 0.15 GB: half.
    for gb, cache in (("0.3", 300_000_000), ("0.15", 150_000_000), ("1", 300_000_000)):
        plan = json.loads(greenroom(*argv, "--stream-optimizer-state-host-cache-gb", gb, "--json", check_rc=0).stdout)
        assert plan["host_cache_bytes_per_rank"] == cache
        assert plan["host_bytes_per_rank"] == cache + (256 << 20)
        assert plan["host_bytes_per_node"] == 2 * plan["host_bytes_per_rank"]
        assert plan["disk_bytes_per_rank"]["streaming"] == 300_000_000  # the files stay preallocated
    out = greenroom(*argv, "--stream-optimizer-state-host-cache-gb", "0.15", check_rc=0).stdout
    assert "host cache per rank: up to 0.15 GB" in out and "50% of the streamed state" in out


def test_plan_exits_2_when_the_state_does_not_fit(disk_dir):
    proc = greenroom(
        "plan", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir", disk_dir, "--params", "1e15"
    )
    assert "DOES NOT FIT" in proc.stdout
    assert "rank(s) need 10.0 PB: " in one_line_error(proc)


def test_plan_verdict_is_not_ok_when_the_host_memory_does_not_fit_though_the_disk_does(disk_dir):
    # The verdict line judged the disk alone: "verdict: OK" above plan's own error and exit 2.
    proc = greenroom(
        "plan",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--params",
        "1e6",
        "--host-memory-gb",
        "0.1",
    )
    assert "of host memory" in one_line_error(proc)
    [verdict] = [line for line in proc.stdout.splitlines() if line.startswith("verdict:")]
    assert verdict.startswith("verdict:    DOES NOT FIT: ")
    assert verdict.endswith("(the disk fits; the error says what does not)")


def test_plan_without_disk_says_so():
    out = greenroom("plan", "--params", "1e6", "--offload-train", check_rc=0).stdout
    assert "offload:    cpu" in out and "disk:       not used" in out


def test_doctor_on_a_real_disk_and_on_a_missing_dir(disk_dir):
    proc = greenroom("doctor", disk_dir, "--no-probe")
    assert proc.returncode == 0 and "verdict:    OK" in proc.stdout
    # The train flag's name works too, and --json gives what plan takes.
    result = json.loads(greenroom("doctor", "--offload-train-disk-dir", disk_dir, "--json", check_rc=0).stdout)
    assert result["fit"] is True and result["dir"] == disk_dir
    assert result["read_gbps"] > 0 and result["write_gbps"] > 0
    assert "is not a directory" in one_line_error(greenroom("doctor", os.path.join(disk_dir, "nope")))


def test_doctor_probes_at_the_concurrency_of_the_ranks_that_will_share_the_disk(disk_dir):
    """``--ranks N``: the node's rates for ``plan --nproc-per-node N``, mixed ones included,
    and the advice names that rank count; the probe leaves nothing in DIR."""
    result = json.loads(greenroom("doctor", disk_dir, "--ranks", "3", "--json", check_rc=0).stdout)
    assert result["ranks"] == 3 and result["read_gbps"] > 0 and result["write_gbps"] > 0
    assert result["mixed_read_gbps"] > 0 and result["mixed_write_gbps"] > 0
    out = greenroom("doctor", disk_dir, "--ranks", "3", check_rc=0).stdout
    assert "(quick probe, 3 ranks at once; greenroom plan --nproc-per-node 3 --disk-read-gbps " in out
    assert os.listdir(disk_dir) == []
    assert "--ranks" in one_line_error(greenroom("doctor", disk_dir, "--ranks", "0"))


def test_doctor_flags_tmpfs():
    from greenroom.io import fs

    if not os.path.isdir("/dev/shm") or fs.mount_of("/dev/shm").fstype != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs mount on this machine: no tmpfs dir to show doctor")
    proc = greenroom("doctor", "/dev/shm", "--no-probe")
    assert proc.returncode == 1 and "NOT FIT: tmpfs keeps the data in RAM" in proc.stdout


def test_doctor_probes_a_disk_with_less_free_than_a_raw_block_and_says_when_it_has_no_room(tmp_path):
    """A 16 MiB filesystem (a tmpfs of its own, root only): the probe's file fits the free
    space, not rounded up to a 64 MiB block that would end doctor in ENOSPC's traceback."""
    small = str(tmp_path / "small")
    os.makedirs(small)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", small], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        proc = greenroom("doctor", small, "--json")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        result = json.loads(proc.stdout)
        assert result["read_gbps"] > 0 and result["write_gbps"] > 0
        assert result["problems"] == ["tmpfs keeps the data in RAM"]
        # Under 4 MiB free (a quarter for the probe, at least 1 MiB) there is nothing to probe in.
        with open(os.path.join(small, "fill"), "wb") as f:
            f.write(b"\0" * (13 << 20))
        result = json.loads(greenroom("doctor", small, "--json").stdout)
        assert result["read_gbps"] is None
        assert result["problems"][1] == "3.1 MB free: too little to probe the bandwidth or hold offloaded state"
        assert "free space: 3.1 MB\n" in greenroom("doctor", small).stdout  # 3 MiB, in the unit that fits it
        line = one_line_error(
            greenroom(
                "plan",
                "--params",
                "1e6",
                "--stream-optimizer-state-to-disk",
                "--offload-train-disk-dir",
                small,
                "--allow-tmpfs",
                "--measure-disk",
            )
        )
        assert "has 3.1 MB free: too little to probe its bandwidth" in line
        assert os.listdir(small) == ["fill"]
    finally:
        subprocess.run(["umount", small], check=True)


def test_bench_disk_json_has_raw_and_engine_figures(disk_dir):
    result = json.loads(
        greenroom("bench", "disk", disk_dir, "--size", "8MiB", "--chunk-mb", "2", "--json", check_rc=0).stdout
    )
    for side in ("raw", "engine"):
        assert result[side]["write_bytes_per_s"] > 0 and result[side]["read_bytes_per_s"] > 0
    assert result["write_ratio"] > 0 and result["read_ratio"] > 0
    # Three passes by default; the headline is their median.
    assert result["repeat"] == 3 and len(result["passes"]) == 3
    for name, spread in result["spread"].items():
        assert spread["min"] <= spread["median"] <= spread["max"], name
    assert result["write_ratio"] == result["spread"]["write_ratio"]["median"]


def test_bench_disk_raw_probe_moves_the_bytes_the_engine_does(disk_dir):
    # A --size under 64 MiB beside a raw probe of one 64 MiB block would make each ratio a
    # 4 MiB transfer's rate over a 64 MiB one's.
    result = json.loads(
        greenroom(
            "bench", "disk", disk_dir, "--size", "4MiB", "--chunk-mb", "2", "--repeat", "1", "--json", check_rc=0
        ).stdout
    )
    assert result["raw"]["nbytes"] == result["engine"]["nbytes"] == 4 << 20
    assert os.listdir(disk_dir) == []


def test_bench_disk_repeat_and_the_train_flag_names(disk_dir):
    proc = greenroom(
        "bench",
        "disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--size",
        "4MiB",
        "--offload-train-disk-chunk-mb",
        "2",
        "--repeat",
        "2",
        check_rc=0,
    )
    assert "2 pass(es): min / median / max" in proc.stdout
    assert [line.split()[0] for line in proc.stdout.splitlines()[2:4]] == ["write", "read"]


def test_a_subcommands_bad_flag_prints_its_own_usage_and_python_m_greenroom_runs(disk_dir):
    import subprocess
    import sys

    proc = greenroom("bench", "disk", disk_dir, "--bogus")
    assert proc.returncode == 2 and proc.stderr.startswith("usage: greenroom bench disk")
    assert "greenroom bench disk: error: unrecognized arguments: --bogus" in proc.stderr
    proc = greenroom("plan", "--params", "7B", "--bogus")
    assert proc.stderr.startswith("usage: greenroom plan") and "greenroom plan: error: unrecognized" in proc.stderr
    out = subprocess.run([sys.executable, "-m", "greenroom", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("greenroom ")


def test_benches_take_the_train_flags_they_print(disk_dir):
    """The line a bench prints about the codec names a flag the bench accepts."""
    from greenroom.cli import main as cli

    for argv in (
        [
            "bench",
            "stream",
            "--params",
            "1000",
            "--offload-train-disk-dir",
            disk_dir,
            "--offload-train-disk-compression",
            "zstd",
            "--stream-optimizer-state-moment-dtype",
            "bf16",
            "--offload-train-disk-chunk-mb",
            "8",
            "--raw-size",
            "1MiB",
        ],
        [
            "bench",
            "offload",
            "--offload-train-target",
            "cpu",
            "--offload-train-disk-compression",
            "none",
            "--offload-backend",
            "portable",
            "--offload-mover",
            "greenroom",
            "--size",
            "1MiB",
        ],
    ):
        parser = cli.build_parser(argv)
        args = parser.parse_args(argv)
        assert args.compression in ("zstd", "none")
    assert os.listdir(disk_dir) == []


# -- one vocabulary, defaults shown, units that fit ----------------------------------

COMMANDS_WITH_HELP = (
    ["plan"],
    ["doctor"],
    ["report"],
    ["train"],
    ["reclaim"],
    ["bench", "stream"],
    ["bench", "disk"],
    ["bench", "offload"],
    ["bench", "codec"],
)


def _parser_of(argv: list[str]):
    from greenroom.cli import main as cli

    parser = cli.build_parser(argv)
    for word in argv:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


@pytest.mark.parametrize("argv", COMMANDS_WITH_HELP, ids=" ".join)
def test_every_help_shows_each_options_default(argv):
    """Every option with a value when not given says it in --help."""
    parser = _parser_of(argv)
    formatter = parser.formatter_class(prog=parser.prog)
    for action in parser._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        assert "default" in formatter._get_help_string(action), f"{' '.join(argv)} {action.option_strings[0]}"
    assert "(default: 1)" in _parser_of(["plan"]).format_help()  # --world-size
    # bench stream --param-dtype says what its default layout stores, not the whole-master 12 B.
    [param_dtype] = [a for a in _parser_of(["bench", "stream"])._actions if "--param-dtype" in a.option_strings]
    assert "10.014 B/param stored with fp32 moments in the default master layout" in param_dtype.help


def test_plan_help_has_only_flags_that_mean_something_to_a_plan():
    text = greenroom("plan", "--help", check_rc=0).stdout
    assert "--no-load-optim" not in text
    assert "--cuda-context-gb" in text and "--nccl-gb" in text


def test_every_bench_takes_the_dir_bare_or_as_the_flag_and_defaults_to_the_train_codec(disk_dir):
    for argv in (
        ["bench", "stream", disk_dir, "--params", "1000"],
        ["bench", "offload", disk_dir],
        ["bench", "codec", "--compression", "zstd", disk_dir],
        ["bench", "disk", disk_dir],
        ["doctor", disk_dir],
    ):
        args = _parser_of(argv[:2] if argv[0] == "bench" else argv[:1]).parse_args(
            argv[2:] if argv[0] == "bench" else argv[1:]
        )
        assert args.dir_positional == disk_dir, argv
        if argv[0] == "bench" and argv[1] != "codec":
            assert args.compression == "auto", argv  # as greenroom train's
    result = json.loads(
        greenroom(
            "bench",
            "disk",
            disk_dir,
            "--size",
            "4MiB",
            "--chunk-mb",
            "4",
            "--repeat",
            "1",
            "--device",
            "cpu",
            "--json",
            check_rc=0,
        ).stdout
    )
    assert result["compression"] == "none"  # auto on a CPU device: none, as train resolves it


def test_doctor_says_what_a_warning_costs_before_it_says_ok(disk_dir):
    proc = subprocess.run(
        [
            "bash",
            "-c",
            'ulimit -l 1024 && exec "$0" -m greenroom.cli.main doctor "$1" --no-probe',
            sys.executable,
            disk_dir,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = proc.stdout.splitlines()
    [warning] = [line for line in lines if line.startswith("warning:")]
    assert "memlock limit (1.0 MB) is below the staging (536.9 MB)" in warning
    assert "a run fails at start-up pinning its staging" in warning
    assert lines[-1] == "verdict:    OK for offload and streaming, at the cost the 1 warning(s) above name"
    # One unit system: decimal figures, no GiB or MiB beside them.
    assert "GiB" not in proc.stdout and "MiB" not in proc.stdout
