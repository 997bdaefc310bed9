"""The seed's flag rules: ValueError from the API, one line and exit 2 from the CLI."""

import argparse
import os
import shlex
import warnings

import pytest

import greenroom
from greenroom.config import OffloadConfig
from tests.cli_support import greenroom as run_greenroom
from tests.cli_support import one_line_error


def parse(*argv):
    parser = greenroom.add_arguments(argparse.ArgumentParser())
    return OffloadConfig.from_args(parser.parse_args(list(argv)))


def test_defaults_match_the_seed(monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    config = parse()
    assert config.offload_train is False
    assert config.offload_train_target == "cpu"
    assert config.offload_train_disk_chunk_mb == 256
    assert config.stream_optimizer_state_moment_dtype == "fp32"
    assert config.no_load_optim is False
    assert config.uses_disk is False


def test_default_disk_dir_is_under_scratch_with_uid(monkeypatch, disk_dir):
    monkeypatch.setenv("SCRATCH", disk_dir)
    config = parse("--offload-train", "--offload-train-target", "disk")
    assert config.offload_train_disk_dir == os.path.join(disk_dir, f"greenroom_train_offload_{os.getuid()}")


def test_disk_target_requires_offload_train(disk_dir):
    with pytest.raises(ValueError, match=r"^--offload-train-target disk requires --offload-train"):
        OffloadConfig(offload_train_target="disk", offload_train_disk_dir=disk_dir)


@pytest.mark.parametrize("chunk", [0, -1, 1.5, True, "8"])
def test_chunk_must_be_a_positive_integer(chunk):
    with pytest.raises(ValueError, match=r"^--offload-train-disk-chunk-mb must be a positive integer"):
        OffloadConfig(offload_train_disk_chunk_mb=chunk)


def test_streaming_under_offload_requires_disk_target(disk_dir):
    with pytest.raises(
        ValueError,
        match=r"^--stream-optimizer-state-to-disk under --offload-train requires "
        r"--offload-train-target disk",
    ):
        OffloadConfig(offload_train=True, stream_optimizer_state_to_disk=True, offload_train_disk_dir=disk_dir)


def test_streaming_alone_is_valid_and_an_explicit_target_is_ignored_with_a_warning(disk_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_disk_dir=disk_dir)
    with pytest.warns(UserWarning, match="--offload-train-target is ignored without --offload-train"):
        OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_target="cpu", offload_train_disk_dir=disk_dir)


def test_both_mechanisms_cost_two_chunks_of_staging(disk_dir):
    both = OffloadConfig(
        offload_train=True,
        offload_train_target="disk",
        stream_optimizer_state_to_disk=True,
        offload_train_disk_dir=disk_dir,
        offload_train_disk_chunk_mb=64,
    )
    assert both.staging_bytes_per_rank == 2 * 64 << 20
    cpu = OffloadConfig(offload_train=True)
    assert cpu.staging_bytes_per_rank == 0


def test_disk_mechanism_without_dir_or_scratch_is_an_error(monkeypatch):
    monkeypatch.delenv("SCRATCH", raising=False)
    monkeypatch.delenv("GREENROOM_DISK_DIR", raising=False)
    with pytest.raises(ValueError, match=r"^no disk dir: pass --offload-train-disk-dir DIR .* or set \$SCRATCH"):
        OffloadConfig(stream_optimizer_state_to_disk=True)


def test_tmpfs_dir_is_refused_unless_allowed():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    with pytest.raises(ValueError, match=r"is on tmpfs .* defeats the purpose.*--allow-tmpfs"):
        OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_disk_dir="/dev/shm/greenroom-test")
    with pytest.warns(UserWarning, match="continuing because of --allow-tmpfs"):
        OffloadConfig(
            stream_optimizer_state_to_disk=True, offload_train_disk_dir="/dev/shm/greenroom-test", allow_tmpfs=True
        )


def test_unknown_moment_dtype_is_refused():
    with pytest.raises(ValueError, match=r"^--stream-optimizer-state-moment-dtype: expected one of"):
        OffloadConfig(stream_optimizer_state_moment_dtype="int4")


@pytest.mark.parametrize("cache", [-1, -0.5, float("nan"), float("inf"), "8", True, None])
def test_host_cache_must_be_a_finite_non_negative_number(disk_dir, cache):
    with pytest.raises(ValueError, match=r"^--stream-optimizer-state-host-cache-gb must be a finite number of GB >= 0"):
        OffloadConfig(
            stream_optimizer_state_to_disk=True,
            offload_train_disk_dir=disk_dir,
            stream_optimizer_state_host_cache_gb=cache,
        )


def test_host_cache_needs_streaming_and_counts_with_the_staging(disk_dir):
    with pytest.raises(
        ValueError,
        match=r"^--stream-optimizer-state-host-cache-gb caches streamed buckets and needs "
        r"--stream-optimizer-state-to-disk",
    ):
        OffloadConfig(offload_train=True, stream_optimizer_state_host_cache_gb=2)
    config = OffloadConfig(
        offload_train=True,
        offload_train_target="disk",
        stream_optimizer_state_to_disk=True,
        offload_train_disk_dir=disk_dir,
        offload_train_disk_chunk_mb=64,
        stream_optimizer_state_host_cache_gb=2,
    )
    assert config.stream_optimizer_state_host_cache_gb == 2.0 and config.host_cache_bytes == 2_000_000_000
    assert config.host_bytes_per_rank == 2_000_000_000 + 2 * (64 << 20)  # the cache counts with the staging
    assert OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_disk_dir=disk_dir).host_cache_bytes == 0
    with pytest.raises(
        ValueError,
        match=r"^--stream-optimizer-state-host-cache-gb 1000000000: that needs .* of host "
        r"memory per rank \(the host cache plus the pinned staging\), this machine has",
    ):
        OffloadConfig(
            stream_optimizer_state_to_disk=True,
            offload_train_disk_dir=disk_dir,
            stream_optimizer_state_host_cache_gb=1e9,
        )


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--offload-train-target", "disk"], "--offload-train-target disk requires --offload-train"),
        (
            ["--offload-train", "--stream-optimizer-state-to-disk"],
            "--stream-optimizer-state-to-disk under --offload-train requires --offload-train-target disk",
        ),
        (["--offload-train-disk-chunk-mb", "0"], "--offload-train-disk-chunk-mb must be a positive integer"),
        (["--stream-optimizer-state-to-disk", "--offload-train-disk-dir", "/dev/shm/gr"], "is on tmpfs"),
        (
            ["--stream-optimizer-state-host-cache-gb", "1"],
            "--stream-optimizer-state-host-cache-gb caches streamed buckets and needs --stream-optimizer-state-to-disk",
        ),
        (
            ["--stream-optimizer-state-master-layout", "fp32"],
            "--stream-optimizer-state-master-layout fp32 lays out streamed masters and needs "
            "--stream-optimizer-state-to-disk",
        ),
    ],
)
def test_cli_prints_one_line_and_exits_2(argv, expected):
    proc = run_greenroom("plan", "--params", "1e6", *argv)
    assert expected in one_line_error(proc)


def test_cli_reports_a_missing_disk_dir(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "SCRATCH"}
    monkeypatch.delenv("SCRATCH", raising=False)
    # train needs the dir; plan still plans without one (it only leaves out the free-space check).
    proc = run_greenroom("train", "--stream-optimizer-state-to-disk", env=env)
    assert "no disk dir" in one_line_error(proc)


def test_cli_rejects_a_choice_outside_the_seed_with_exit_2():
    proc = run_greenroom("plan", "--params", "1e6", "--offload-train-target", "nvme")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "flags",
    [
        dict(),
        dict(offload_train=True),
        dict(
            offload_train=True,
            offload_train_target="disk",
            offload_train_disk_dir="/nvme/x",
            offload_train_disk_chunk_mb=64,
            stream_optimizer_state_to_disk=True,
            stream_optimizer_state_moment_dtype="bf16",
            no_load_optim=True,
        ),
        dict(stream_optimizer_state_to_disk=True, offload_train_disk_dir="/nvme/x", allow_tmpfs=True),
        dict(stream_optimizer_state_to_disk=True, stream_optimizer_state_host_cache_gb=8),
        dict(stream_optimizer_state_to_disk=True, stream_optimizer_state_host_cache_gb=0.1 + 0.2),
        dict(stream_optimizer_state_to_disk=True, stream_optimizer_state_master_layout="fp32"),
    ],
)
def test_to_argv_parses_back_to_the_same_flags(flags):
    from greenroom.config import OffloadFlags

    original = OffloadFlags(**flags)
    ns = greenroom.add_arguments(argparse.ArgumentParser()).parse_args(original.to_argv())
    assert OffloadFlags.from_args(ns) == original


def test_to_argv_writes_the_host_cache_only_when_set():
    from greenroom.config import OffloadFlags

    assert "--stream-optimizer-state-host-cache-gb" not in OffloadFlags(stream_optimizer_state_to_disk=True).to_argv()
    argv = OffloadFlags(stream_optimizer_state_to_disk=True, stream_optimizer_state_host_cache_gb=8).to_argv()
    assert argv[argv.index("--stream-optimizer-state-host-cache-gb") + 1] == "8"  # as Helm and YAML write it
    argv = OffloadFlags(stream_optimizer_state_to_disk=True, stream_optimizer_state_host_cache_gb=0.5).to_argv()
    assert argv[argv.index("--stream-optimizer-state-host-cache-gb") + 1] == "0.5"


def test_master_layout_defaults_to_remainder_and_is_written_only_when_whole(monkeypatch, disk_dir):
    from greenroom.config import OffloadFlags

    assert OffloadFlags().stream_optimizer_state_master_layout == "remainder"
    assert "--stream-optimizer-state-master-layout" not in OffloadFlags(stream_optimizer_state_to_disk=True).to_argv()
    argv = OffloadFlags(stream_optimizer_state_to_disk=True, stream_optimizer_state_master_layout="fp32").to_argv()
    assert argv[argv.index("--stream-optimizer-state-master-layout") + 1] == "fp32"
    # $GREENROOM_ARGS carries it to any trainer's parser, as the other flags.
    monkeypatch.setenv("GREENROOM_ARGS", " ".join(argv))
    assert OffloadFlags.from_env().stream_optimizer_state_master_layout == "fp32"
    with pytest.raises(
        ValueError,
        match=r"^--stream-optimizer-state-master-layout: expected one of remainder, fp32, "
        r"got 'fp16'$",
    ):
        OffloadFlags(stream_optimizer_state_to_disk=True, stream_optimizer_state_master_layout="fp16")


def test_from_config_builds_streaming_adam_with_the_master_layout(disk_dir):
    import torch

    from greenroom.optim import StreamingAdam

    params = [torch.nn.Parameter(torch.randn(5000, dtype=torch.bfloat16))]
    for layout in ("remainder", "fp32"):
        config = OffloadConfig(
            stream_optimizer_state_to_disk=True,
            offload_train_disk_dir=disk_dir,
            stream_optimizer_state_master_layout=layout,
        )
        opt = StreamingAdam.from_config(params, config, os.path.join(disk_dir, layout), resident_numel=0)
        try:
            assert opt.store.master_layout == layout
        finally:
            opt.close()


def test_offload_flags_check_the_rules_without_touching_the_filesystem():
    from greenroom.config import OffloadFlags

    # A dir that cannot exist here is fine: only OffloadConfig resolves and checks it.
    OffloadFlags(stream_optimizer_state_to_disk=True, offload_train_disk_dir="/dev/shm/on-the-node")
    with pytest.raises(ValueError, match="requires --offload-train-target disk"):
        OffloadFlags(offload_train=True, stream_optimizer_state_to_disk=True)


# -- $GREENROOM_ARGS: the flags for any trainer (the chart and the Slurm templates set it) --
def test_from_env_reads_greenroom_args_and_add_arguments_takes_its_defaults_from_it(monkeypatch, disk_dir):
    flags = [
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        disk_dir,
        "--stream-optimizer-state-to-disk",
        "--stream-optimizer-state-moment-dtype",
        "bf16",
    ]
    monkeypatch.setenv("GREENROOM_ARGS", shlex.join(flags))
    from_env = OffloadConfig.from_env()
    assert from_env == OffloadConfig.from_args(greenroom.add_arguments(argparse.ArgumentParser()).parse_args(flags))
    assert from_env.offload_to_disk and from_env.stream_optimizer_state_moment_dtype == "bf16"
    # add_arguments: the env gives the defaults, the command line still wins.
    assert parse().stream_optimizer_state_moment_dtype == "bf16"
    assert parse("--stream-optimizer-state-moment-dtype", "fp16").stream_optimizer_state_moment_dtype == "fp16"
    monkeypatch.delenv("GREENROOM_ARGS")
    assert OffloadConfig.from_env() == OffloadConfig()


def test_greenroom_disk_dir_is_the_default_disk_dir(monkeypatch, disk_dir):
    monkeypatch.setenv("GREENROOM_DISK_DIR", disk_dir)
    monkeypatch.setenv("SCRATCH", "/elsewhere")
    assert OffloadConfig(stream_optimizer_state_to_disk=True).offload_train_disk_dir == disk_dir


@pytest.mark.parametrize(
    "text, expected",
    [
        ("--offload-train --epochs 3", "$GREENROOM_ARGS: --epochs 3 is not a greenroom offload/streaming flag"),
        ("--offload-train-target nvme", "$GREENROOM_ARGS: argument --offload-train-target: invalid choice: 'nvme'"),
        ("--offload-train-disk-chunk-mb 'x", "$GREENROOM_ARGS: cannot split"),
    ],
)
def test_a_bad_greenroom_args_is_one_line_naming_the_variable(monkeypatch, text, expected):
    monkeypatch.setenv("GREENROOM_ARGS", text)
    with pytest.raises(ValueError) as e:
        OffloadConfig.from_env()
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)
    line = one_line_error(run_greenroom("plan", env={"GREENROOM_ARGS": text}))
    assert expected in line
