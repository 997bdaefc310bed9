"""The frame codecs a run can name (``--offload-train-disk-compression``) and the one rule
for naming one. Torch-free, so the flags, ``plan`` and the Slurm renderer check a name
without loading the codecs themselves (``greenroom.io.compression``)."""

from __future__ import annotations

from greenroom.errors import ConfigError

CODECS = ("auto", "none", "nvcomp-ans", "zstd")
"""``auto`` runs nvcomp-ans where CUDA is up and nvCOMP loads, else none."""

FLAG = "--offload-train-disk-compression"

MIN_COMPRESSED_CHUNK_MB = 4
"""A compressed frame is one MiB and each of the engine's 4 staging buffers holds whole frames."""


def frames_fit(chunk_mb: int) -> bool:
    """Whether a staging chunk of ``chunk_mb`` MiB holds whole one-MiB frames in each staging buffer."""
    return chunk_mb >= MIN_COMPRESSED_CHUNK_MB


def check_codec_name(codec: str, *, name: str = FLAG) -> None:
    """Refuse, in one line naming the flag or key ``name``, a codec name that does not exist."""
    if codec not in CODECS:
        raise ConfigError(f"{name}: expected one of {', '.join(CODECS)}, got {codec!r}")


def check_codec(codec: str, chunk_mb: int) -> None:
    """Refuse, in one line naming the flag, a codec name that does not exist, or a named
    codec (not auto or none) with a staging chunk too small for its frames."""
    check_codec_name(codec)
    if codec not in ("auto", "none") and not frames_fit(chunk_mb):
        raise ConfigError(
            f"{FLAG} {codec} needs --offload-train-disk-chunk-mb "
            f"{MIN_COMPRESSED_CHUNK_MB} or more (one-MiB frames in each staging buffer), got {chunk_mb}"
        )
