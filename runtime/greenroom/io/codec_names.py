"""The frame codecs a run can name (``--offload-train-disk-compression``) and the one rule
for naming one. Torch-free, so the flags, ``plan`` and the Slurm renderer check a name
without loading the codecs themselves (``greenroom.io.compression``)."""

from __future__ import annotations

from greenroom.errors import ConfigError

CODECS = ("auto", "none", "nvcomp-ans", "zstd")
"""``auto`` runs nvcomp-ans where CUDA is up and nvCOMP loads, else none."""

MIN_COMPRESSED_CHUNK_MB = 4
"""A compressed frame is one MiB and each of the engine's 4 staging buffers holds whole frames."""


def check_codec(codec: str, chunk_mb: int) -> None:
    """Refuse, in one line naming the flag, a codec name that does not exist, or a named
    codec (not auto or none) with a staging chunk too small for its frames."""
    if codec not in CODECS:
        raise ConfigError(f"--offload-train-disk-compression: expected one of {', '.join(CODECS)}, got {codec!r}")
    if codec not in ("auto", "none") and chunk_mb < MIN_COMPRESSED_CHUNK_MB:
        raise ConfigError(
            f"--offload-train-disk-compression {codec} needs --offload-train-disk-chunk-mb "
            f"{MIN_COMPRESSED_CHUNK_MB} or more (one-MiB frames in each staging buffer), got {chunk_mb}"
        )
