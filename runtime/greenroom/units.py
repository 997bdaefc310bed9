"""The one syntax every command takes for sizes and counts.

Bytes (``--size``, ``--raw-size``, ...): a number with an optional unit, binary
``KiB MiB GiB TiB`` or decimal ``KB MB GB TB`` (``4GiB``, ``512MiB``, ``1.5GB``,
``1000000``). Counts (``--params``): a number with an optional decimal suffix ``K M B T``
or an exponent (``7B``, ``70B``, ``744e9``, ``1.5T``, ``2000000``).

Both are argparse ``type=`` callables: a bad value is argparse's one-line error naming
the flag, exit 2.
"""

from __future__ import annotations

import argparse
import math
import re

MIB = 1 << 20
GIB = 1 << 30
GB = 1e9
"""Decimal, for the rates and sizes reports print (disk vendors' GB/s)."""

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([+-]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: dict[str, int], what: str, examples: str) -> float:
    match = _NUMBER.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in units:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} (e.g. {examples})")
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value):  # the regex takes no inf or nan: past a float's range (1e400, 1e308TiB)
        raise argparse.ArgumentTypeError(f"{text!r} is too large to be {what} (e.g. {examples})")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive {what.split()[-1]}")
    return value


def parse_bytes(text: str) -> int:
    """``4GiB`` -> 4294967296; a whole number of bytes."""
    value = _parse(text, _BYTE_UNITS, "a size", "4GiB, 512MiB, 1.5GB, 1000000")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def bytes_or_zero(text: str) -> int:
    """``parse_bytes``, or 0 for any spelling of zero (``0``, ``0B``, ``0GiB``, ``0.0``): a
    size whose default is none (``--untracked-size``)."""
    match = _NUMBER.match(text)
    if match and match.group(2).lower() in _BYTE_UNITS and float(match.group(1)) == 0:
        return 0
    return parse_bytes(text)


def parse_count(text: str) -> int:
    """``7B`` -> 7000000000; a whole count (of params, elements)."""
    value = _parse(text, _COUNT_UNITS, "a count", "7B, 70B, 744e9, 2000000")
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def positive_int(text: str) -> int:
    """A positive integer flag value (``--repeat 3``, ``--world-size 64``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


# The most GB a memory flag takes: an exabyte, far past any node, still an exact int of bytes.
MAX_GB = 1e9


def gigabytes(text: str) -> float:
    """A memory size in GB (``--gpu-memory-gb 80``): positive, at most ``MAX_GB``."""
    value = positive_float(text)
    if value > MAX_GB:
        raise argparse.ArgumentTypeError(f"{text} GB is more than an exabyte ({MAX_GB:g} GB): give the size in GB")
    return value


def gigabytes_or_zero(text: str) -> float:
    """``gigabytes``, or 0 for any spelling of zero (``--nccl-gb 0``: none assumed)."""
    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass
    return gigabytes(text)


# The disk bandwidths a plan takes, GB/s: from 1 KB/s to a PB/s. Past them the seconds
# (bytes over bytes per second) overflow to inf, or the bytes per second do.
MIN_GBPS, MAX_GBPS = 1e-6, 1e6


def gbps(text: str) -> float:
    """A disk bandwidth in GB/s (``--disk-read-gbps 6.5``), from ``MIN_GBPS`` to ``MAX_GBPS``."""
    value = positive_float(text)
    if not MIN_GBPS <= value <= MAX_GBPS:
        raise argparse.ArgumentTypeError(f"{text} GB/s: expected {MIN_GBPS:g} (1 KB/s) to {MAX_GBPS:g} (1 PB/s)")
    return value


def positive_float(text: str) -> float:
    """A positive finite number (``--gpu-memory-gb 80``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def size_text(nbytes: float) -> str:
    """A byte count in decimal units for figures printed beside GB (``279.0 GB``,
    ``256.0 MB``, ``4.1 KB``, ``512 B``): one unit system, and small figures not as
    ``0.00 GB``."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def rate_text(bytes_per_s: float) -> str:
    """A bandwidth in decimal units (``6.52 GB/s``, ``310.4 MB/s``, ``2.1 KB/s``)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if abs(bytes_per_s) >= scale:
            return f"{bytes_per_s / scale:.{2 if unit == 'GB/s' else 1}f} {unit}"
    return f"{bytes_per_s:.0f} B/s"
