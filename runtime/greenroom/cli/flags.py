"""The flags the benches and ``doctor`` share with ``greenroom train``, spelled as train
spells them (``--offload-train-disk-dir``, ...), each with its short alias (``--dir``)
and the short ``dest`` the bench code reads. One place, so a bench never prints a train
flag it then rejects.
"""

from __future__ import annotations

import argparse

from greenroom.config import DEFAULT_CHUNK_MB, MASTER_LAYOUTS, MOMENT_DTYPES, TARGETS
from greenroom.errors import ConfigError
from greenroom.io.codec_names import CODECS as COMPRESSIONS


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows every option's default: appended as ``(default: X)`` where the help
    does not say it already, except a flag that is off (``store_true``) or has no value
    unless given (default None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, False)
            or action.default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def disk_dir(
    parser: argparse.ArgumentParser,
    *,
    required: bool = False,
    positional: bool = False,
    help: str = "a dir on node-local NVMe",
) -> None:
    """``--offload-train-disk-dir DIR`` (alias ``--dir``); with ``positional``, a bare
    DIR is accepted too (``greenroom doctor /nvme``)."""
    parser.add_argument(
        "--offload-train-disk-dir",
        "--dir",
        dest="dir",
        metavar="DIR",
        default=None,
        required=required and not positional,
        help=help,
    )
    if positional:
        parser.add_argument("dir_positional", nargs="?", metavar="DIR", help="the same, given bare")


def resolve_disk_dir(args: argparse.Namespace, command: str, *, required: bool = True) -> str | None:
    """The dir of a command that takes it bare or as the flag (one of the two); None
    where neither is given and the command does without (not ``required``)."""
    given = [d for d in (args.dir_positional, args.dir) if d is not None]
    if not given and not required:
        return None
    if not given:
        raise ConfigError(f"{command}: give the dir: --offload-train-disk-dir DIR (or DIR)")
    if len(given) == 2 and given[0] != given[1]:
        raise ConfigError(f"{command}: DIR {given[0]} and --offload-train-disk-dir {given[1]} differ: give one")
    args.dir = given[0]
    return args.dir


def chunk_mb(parser: argparse.ArgumentParser, *, help: str = "pinned host staging, MiB (default %(default)s)") -> None:
    parser.add_argument(
        "--offload-train-disk-chunk-mb",
        "--chunk-mb",
        dest="chunk_mb",
        type=int,
        default=DEFAULT_CHUNK_MB,
        metavar="MB",
        help=help,
    )


def compression(
    parser: argparse.ArgumentParser,
    *,
    default: str | None = "auto",
    choices=COMPRESSIONS,
    required: bool = False,
    help: str = "lossless codec of what goes to disk",
) -> None:
    parser.add_argument(
        "--offload-train-disk-compression",
        "--compression",
        dest="compression",
        choices=choices,
        default=default,
        required=required,
        help=f"{help} (default %(default)s)" if default else help,
    )


def moment_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stream-optimizer-state-moment-dtype",
        "--moment-dtype",
        dest="moment_dtype",
        choices=MOMENT_DTYPES,
        default="fp32",
        help="storage dtype of the streamed Adam moments",
    )


def master_layout(parser: argparse.ArgumentParser) -> None:
    """``--stream-optimizer-state-master-layout`` (alias ``--master-layout``); default None
    (not given) resolves to ``remainder``, so a command can refuse an explicit value that
    does not apply (``resolve_master_layout``)."""
    parser.add_argument(
        "--stream-optimizer-state-master-layout",
        "--master-layout",
        dest="master_layout",
        choices=MASTER_LAYOUTS,
        default=None,
        help="how a bf16 param's fp32 master is stored: its low 16 bits beside the param "
        "(remainder, the default) or whole (fp32)",
    )


def resolve_master_layout(args: argparse.Namespace, command: str) -> str:
    """The master layout of a command whose params are ``args.param_dtype``: a layout
    given for fp32 params (their own masters, nothing is laid out) is refused."""
    if args.master_layout is not None and args.param_dtype != "bf16":
        raise ConfigError(
            f"{command}: --stream-optimizer-state-master-layout {args.master_layout} lays out the fp32 "
            f"masters of bf16 params; --param-dtype {args.param_dtype} params are their own masters: "
            "drop the master layout (or use --param-dtype bf16)"
        )
    args.master_layout = args.master_layout or "remainder"
    return args.master_layout


def host_cache_gb(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stream-optimizer-state-host-cache-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="host memory (GB) that keeps whole buckets off the disk (default 0: all stream)",
    )


def target(parser: argparse.ArgumentParser, *, default: str = "disk") -> None:
    parser.add_argument(
        "--offload-train-target",
        "--target",
        dest="target",
        choices=TARGETS,
        default=default,
        help="where the sleeping actor goes (default %(default)s)",
    )


def backend_and_mover(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--offload-backend",
        "--backend",
        dest="backend",
        choices=("auto", "tms", "portable"),
        default="auto",
        help="actor offload backend (default: torch_memory_saver on CUDA)",
    )
    parser.add_argument(
        "--offload-mover",
        "--mover",
        dest="mover",
        choices=("greenroom", "tms"),
        default="greenroom",
        help="on torch_memory_saver: who copies the bytes",
    )


def device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the tensors live (default auto: cuda when available, else cpu)",
    )


def json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
