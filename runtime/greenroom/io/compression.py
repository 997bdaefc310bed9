"""Lossless frame codecs of the I/O engine: fewer bytes to the disk than the state holds.

The disk is the limit of both mechanisms (docs/benchmarks.md), so the only way past it is
to move fewer bytes. ``io.engine.TransferEngine`` cuts every transfer of a compressed
``StateFile`` into *frames*, one per ``io.engine.EXTENT`` of the file, and hands each frame
to a codec here. A frame that shrinks is stored as a header and the payload; one that
does not pay (less than ``MIN_RATIO``) is stored raw; a chunk's frames are packed back
to back (Note [packed frames] of ``greenroom.io.frames``). The file stays preallocated at the raw
size, so running out of space is still a setup error; what and where each frame stored
is recorded beside its checksum, so a read fetches only the stored bytes.

Codecs (``--offload-train-disk-compression``):

``nvcomp-ans``
    nvCOMP's ANS on the GPU (the ``nvidia-nvcomp-cu13``/``-cu12`` wheel of torch's CUDA
    major; ``greenroom.io.nvcomp_codec``): byte planes; a frame of 2-byte elements keeps
    the smaller of byte planes and nvCOMP's 16-bit mode (Note [16-bit frames] of
    ``greenroom.io.nvcomp_codec``).
    Runs on the device before the bytes cross to the host, many times faster than the
    disk each way in the engine's calls (Note [batched decode] of
    ``greenroom.io.nvcomp_codec``; docs/benchmarks.md, 'Compression: the codec alone').
    What ``auto`` runs where CUDA is up and the wheel loads.
``zstd``
    Byte planes, then Zstandard level 1 on the host, in the engine's I/O threads. The same
    frame format, for machines without a GPU (and the CI). It compresses about as well but
    runs slower per core than an NVMe disk (docs/benchmarks.md, 'Compression: the codec
    alone'), so ``auto`` does not pick it.

Note [byte planes]: the bytes of a float differ in how random they are: the sign and
exponent byte repeats across neighbouring elements while the low mantissa bytes are
near noise. Interleaved, a byte-oriented coder sees noise everywhere; split into planes
(plane k holds byte k of every element, a pure permutation of the frame) the exponent
plane compresses several-fold and the noise planes cost what they are. On a trained
model's state ANS over the planes stores every kind of tensor smaller than ANS over the
interleaved bytes.

Note [frame checks]: a stored frame is checked three ways before its bytes are used:
the engine's position-weighted sums of the stored bytes and of the file's record of the
frame (a flipped bit on the disk, a damaged record: Note [summed records] of
``greenroom.io.statefile``), the header (magic, codec, element size, raw and stored lengths
must all agree with the file's record) and, for ``zstd``, Zstandard's own checksum of the raw bytes, which also
catches a codec that decodes to the wrong bytes. nvCOMP's checksum policy is not relied
on: with nvCOMP 6.0's Python API a payload with a flipped bit decodes silently under
``COMPUTE_AND_VERIFY``, so on the GPU the engine's sums of the stored
bytes are the check (which is why ``GREENROOM_VERIFY=0`` is for measurement only). Each
failure is one ``IntegrityError`` naming the file and offset.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np

from greenroom.errors import ConfigError, IntegrityError
from greenroom.io.codec_names import MIN_COMPRESSED_CHUNK_MB, check_codec, frames_fit
from greenroom.io.nvcomp_codec import NVCOMP_F16_ID, NvcompPlanes
from greenroom.units import MIB

MIN_RATIO = 1.03
"""A frame is stored compressed only when it shrinks by at least this factor."""

HEADER_BYTES = 64
"""The header before a compressed frame's payload (padded: payloads start 64-byte aligned)."""

MAGIC = b"GRZF"
_HEADER = struct.Struct("<4sBBxxII")  # magic, codec id, element size, raw bytes, payload bytes


def plane_split(frame: np.ndarray, itemsize: int) -> np.ndarray:
    """A host frame's bytes reordered into ``itemsize`` planes (Note [byte planes]; the
    device codec splits whole runs of frames in its own kernels, Note [batched decode] of
    ``greenroom.io.nvcomp_codec``)."""
    if itemsize == 1:
        return frame
    return np.ascontiguousarray(frame.reshape(-1, itemsize).T).reshape(-1)


def plane_join(planes: np.ndarray, out: np.ndarray, itemsize: int) -> None:
    """Write the host frame whose planes are ``planes`` into ``out`` (the inverse of ``plane_split``)."""
    if itemsize == 1:
        out[:] = planes
        return
    out.reshape(-1, itemsize)[:] = planes.reshape(itemsize, -1).T


def pays(raw_bytes: int, payload_bytes: int) -> bool:
    return (HEADER_BYTES + payload_bytes) * MIN_RATIO <= raw_bytes


def pack_header(codec_id: int, itemsize: int, raw_bytes: int, payload_bytes: int) -> bytes:
    return _HEADER.pack(MAGIC, codec_id, itemsize, raw_bytes, payload_bytes).ljust(HEADER_BYTES, b"\0")


def parse_header(header: bytes, *, raw_bytes: int, stored_bytes: int, where: str) -> tuple[int, int]:
    """The codec id and element size of a compressed frame's header, after checking it
    against what the file recorded for the frame (Note [frame checks])."""
    magic, codec_id, itemsize, raw, payload = _HEADER.unpack_from(header)
    if (
        magic != MAGIC
        or raw != raw_bytes
        or HEADER_BYTES + payload != stored_bytes
        or itemsize not in (1, 2, 4, 8)
        or raw % itemsize
    ):
        raise IntegrityError(
            f"{where}: the compressed frame's header does not match the file's record of it "
            "(a flipped bit, a failing disk or a stray write); stopped before using it: "
            "restart from the last checkpoint"
        )
    return codec_id, itemsize


class ZstdPlanes:
    """Byte planes + Zstandard level 1, on the host (thread-safe: one context per thread)."""

    name = "zstd"
    id = 1
    on_device = False

    def __init__(self) -> None:
        import zstandard

        self._zstd = zstandard
        self._local = threading.local()

    def _contexts(self):
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = (
                self._zstd.ZstdCompressor(level=1, write_checksum=True),
                self._zstd.ZstdDecompressor(),
            )
        return ctx

    def encode(self, frame: np.ndarray, itemsize: int) -> bytes:
        return self._contexts()[0].compress(plane_split(frame, itemsize))

    def decode(self, payload: memoryview, out: np.ndarray, itemsize: int, where: str) -> None:
        try:
            planes = self._contexts()[1].decompress(payload, max_output_size=out.nbytes)
        except self._zstd.ZstdError as e:
            raise IntegrityError(
                f"{where}: the compressed frame does not decode ({e}): a flipped bit, a failing "
                "disk or a stray write; stopped before using it: restart from the last "
                "checkpoint"
            ) from None
        if len(planes) != out.nbytes:
            raise IntegrityError(
                f"{where}: the compressed frame decodes to {len(planes)} bytes, expected "
                f"{out.nbytes}; stopped before using it: restart from the last checkpoint"
            )
        plane_join(np.frombuffer(planes, dtype=np.uint8), out, itemsize)


# Stored bytes per raw byte expected on a trained model's state, per kind of tensor: what
# ``greenroom plan`` reports. nvcomp-ans: a 207M-param Llama after 5 AdamW steps (byte
# planes, nvCOMP's default chunks; Note [ANS chunks] of greenroom.io.nvcomp_codec stores a
# little less), except bf16 weights: the offload bench's trained actor (Notes [16-bit
# frames] and [ANS chunks] of greenroom.io.nvcomp_codec; docs/benchmarks.md, 'Actor
# offload'); zstd: a 2-layer MLP after 20 AdamW steps. Kinds not measured count as
# incompressible.
EXPECTED_RATIO = {
    "nvcomp-ans": {
        "fp32 master": 1.16,
        "fp32 exp_avg": 1.30,
        "fp32 exp_avg_sq": 1.36,
        "bf16 weights": 1.49,
        "bf16 exp_avg": 1.60,
        "bf16 exp_avg_sq": 1.77,
    },
    "zstd": {
        "fp32 master": 1.20,
        "fp32 exp_avg": 1.19,
        "fp32 exp_avg_sq": 1.29,
        "bf16 weights": 1.49,
        "bf16 exp_avg": 1.47,
        "bf16 exp_avg_sq": 1.47,
    },
}


def expected_ratio(codec_name: str | None, kind: str) -> float:
    """How many times smaller ``kind`` (say "fp32 master") is expected to be on disk."""
    return EXPECTED_RATIO.get(codec_name or "", {}).get(kind, 1.0)


_CODECS = {ZstdPlanes.id: ZstdPlanes, NvcompPlanes.id: NvcompPlanes, NVCOMP_F16_ID: NvcompPlanes}
_BY_NAME = {c.name: c for c in _CODECS.values()}
_loaded: dict[int, object] = {}
_load_lock = threading.Lock()


def _load(cls):
    with _load_lock:
        if cls.id not in _loaded:
            _loaded[cls.id] = cls()
        return _loaded[cls.id]


def codec_by_id(codec_id: int, where: str):
    """The codec a frame's header names (to read a file another run wrote)."""
    cls = _CODECS.get(codec_id)
    if cls is None:
        raise IntegrityError(
            f"{where}: the frame names codec {codec_id}, which this greenroom does not know: "
            "a newer greenroom wrote it, or the bytes are damaged"
        )
    try:
        return _load(cls)
    except ImportError as e:
        raise ConfigError(
            f"{where}: the frame was compressed with {cls.name}, which cannot load here ({e}); {_INSTALL[cls.name]}"
        ) from None


_INSTALL = {
    "zstd": "pip install zstandard",
    "nvcomp-ans": "it needs CUDA and the nvCOMP wheel of torch's CUDA major (pip install nvidia-nvcomp-cu13 "
    "or nvidia-nvcomp-cu12)",
}


@dataclass(frozen=True, slots=True)
class ResolvedCodec:
    """What ``--offload-train-disk-compression CHOICE`` runs on one device with one staging
    chunk: resolved once per run (``resolve``) and handed to every mechanism that writes,
    so the line a run prints names the codec its files get."""

    choice: str
    """The name the user gave (``auto``, ``none``, ``nvcomp-ans``, ``zstd``)."""
    codec: object | None
    """The frame codec that runs; None: none."""
    line: str
    """One line saying which codec runs and why."""
    cuda: bool
    """Resolved for a CUDA device (True) or the host."""
    chunk_bytes: int
    """Resolved for this staging chunk."""


def resolve(choice: str, *, cuda: bool, chunk_bytes: int) -> ResolvedCodec:
    """The codec ``--offload-train-disk-compression CHOICE`` runs, and one line saying
    which and why. ``auto`` is ``nvcomp-ans`` where CUDA is up and nvCOMP loads, else none
    (never the host codec: ``zstd`` runs slower than an NVMe disk)."""
    codec, line = _resolve(choice, cuda=cuda, chunk_bytes=chunk_bytes)
    return ResolvedCodec(choice=choice, codec=codec, line=line, cuda=cuda, chunk_bytes=chunk_bytes)


def resolved(given: str | ResolvedCodec, *, cuda: bool, chunk_bytes: int, what: str) -> ResolvedCodec:
    """``given`` as the codec that runs: a choice (``auto``...) is resolved here, a
    ``ResolvedCodec`` (what a run resolved once) is taken as it is, after checking it was
    resolved for this device and chunk; ``what`` names the caller in that refusal."""
    if not isinstance(given, ResolvedCodec):
        return resolve(given, cuda=cuda, chunk_bytes=chunk_bytes)
    if (given.cuda, given.chunk_bytes) != (cuda, chunk_bytes):
        raise ConfigError(
            f"{what}: compression {given.choice!r} was resolved for {_for(given.cuda, given.chunk_bytes)}, "
            f"this runs on {_for(cuda, chunk_bytes)}; pass the name ({given.choice!r}) to resolve it here"
        )
    return given


def _for(cuda: bool, chunk_bytes: int) -> str:
    return f"{'CUDA' if cuda else 'the host'} with a {chunk_bytes / MIB:g} MiB chunk"


def _resolve(choice: str, *, cuda: bool, chunk_bytes: int):
    check_codec(choice, chunk_bytes // MIB)
    if choice == "none":
        return None, "compression: none (--offload-train-disk-compression none)"
    if choice == "auto":
        if not cuda:
            return None, (
                "compression: none (auto: no GPU for nvcomp-ans; the host codec zstd runs slower than an "
                "NVMe disk, pass --offload-train-disk-compression zstd to use it anyway)"
            )
        if not frames_fit(chunk_bytes // MIB):
            return None, (
                f"compression: none (auto: --offload-train-disk-chunk-mb is under "
                f"{MIN_COMPRESSED_CHUNK_MB}, too small for one-MiB frames)"
            )
        try:
            return _load(NvcompPlanes), "compression: nvcomp-ans (auto)"
        except (ImportError, OSError) as e:
            return None, f"compression: none (auto: nvCOMP does not load: {e}; {_INSTALL['nvcomp-ans']})"
    cls = _BY_NAME[choice]
    if cls.on_device and not cuda:
        raise ConfigError(f"--offload-train-disk-compression {choice}: needs CUDA; use zstd, auto or none")
    try:
        codec = _load(cls)
    except ImportError as e:
        raise ConfigError(
            f"--offload-train-disk-compression {choice}: the codec does not load ({e}); {_INSTALL[choice]}"
        ) from None
    return codec, f"compression: {choice}"
