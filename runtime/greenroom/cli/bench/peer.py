"""``bench stream --against deepspeed``: run the peer (``greenroom.cli.bench.deepspeed_peer``)
in a child process and put its figures beside greenroom's, with the ratios the issue
asks for (step time and host RSS, greenroom over DeepSpeed). Nothing here imports
DeepSpeed: the child does."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

from greenroom.errors import ConfigError, GreenroomError
from greenroom.units import GB

PREFIX = "GREENROOM-PEER "


def check_deepspeed(args: argparse.Namespace) -> None:
    """Refuse ``--against deepspeed`` in one line where it cannot run (checked before
    greenroom's own measurement, so no time is spent first)."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "--against deepspeed: DeepSpeed is not installed; install the bench-only extra "
            "(pip install 'greenroom[deepspeed]', with libaio-dev for its async_io op)"
        )
    import torch

    if args.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError("--against deepspeed: DeepSpeed's ZeRO-Infinity runs on CUDA only; run it on a GPU machine")
    if args.param_dtype != "bf16":
        raise ConfigError(
            "--against deepspeed: the peer runs bf16 params (ZeRO-3 with bf16 on); use --param-dtype bf16"
        )


def beside_deepspeed(args: argparse.Namespace, ours: dict) -> dict:
    """The peer's figures on the same params and dir, and greenroom's over them."""
    from greenroom.dirs.rankdir import RankDir

    env = dict(os.environ)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")  # DeepSpeed's op builder cannot parse torch's "9.0a"
    # The peer's files go in a rank dir of the bench's, removed after: --dir is the user's,
    # and a "deepspeed-nvme" of theirs there must not go with the peer's.
    with RankDir(args.dir, role="bench-stream-deepspeed", allow_tmpfs=args.allow_tmpfs) as rank_dir:
        command = [
            sys.executable,
            "-m",
            "greenroom.cli.bench.deepspeed_peer",
            "--params",
            str(int(args.params)),
            "--dir",
            rank_dir.path,
            "--steps",
            str(args.steps),
            "--param-numel",
            str(args.param_numel),
        ]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise GreenroomError(f"--against deepspeed: the DeepSpeed run failed (exit {proc.returncode}): {tail[0]}")
    peer = json.loads(lines[-1][len(PREFIX) :])
    return {**peer, **ratios(ours, peer)}


def ratios(ours: dict, peer: dict) -> dict:
    """greenroom's figures over the peer's, each side measured the same way."""
    return {
        "step_ratio": ours["step_seconds"] / peer["step_seconds"],
        # The peer's peak spans its initialization and its steps: so does ours here.
        "host_rss_ratio": (
            max(ours["host_rss_peak_bytes"], ours["init_host_rss_peak_bytes"]) / peer["host_rss_peak_bytes"]
        ),
        # Both all the process held on the device (params and grads included).
        "device_ratio": ours["peak_device_total_bytes"] / peer["peak_device_bytes"],
    }


def print_beside(r: dict) -> None:
    d = r["against"]
    print(
        f"DeepSpeed {d['deepspeed']} ZeRO-Infinity (stage 3, optimizer on NVMe, CPU AdamW), {d['params']:,} bf16 "
        f"params, same dir: steps "
        + ", ".join(f"{s['step_seconds']:.2f}" for s in d["steps"])
        + f" s (forward+backward {d['steps'][-1]['forward_backward_seconds']:.2f} s; CPU in the last step "
        f"{d['steps'][-1]['cpu_seconds']:.2f} s), host RSS peak "
        f"{d['host_rss_peak_bytes'] / GB:.2f} GB, peak device {d['peak_device_bytes'] / GB:.2f} GB"
    )
    print(
        f"greenroom / DeepSpeed: step {d['step_ratio']:.2f}x, host RSS {d['host_rss_ratio']:.2f}x, "
        f"peak device {d['device_ratio']:.2f}x"
    )
