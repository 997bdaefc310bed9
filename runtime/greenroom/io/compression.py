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
    major): byte planes; a frame of 2-byte elements keeps the smaller of byte planes and
    nvCOMP's 16-bit mode (Note [16-bit frames]).
    Runs on the device before the bytes cross to the host, many times faster than the
    disk each way in the engine's calls (Note [batched decode]; docs/benchmarks.md,
    'Compression: the codec alone'). What ``auto`` runs where CUDA is up and the wheel
    loads.
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

Note [16-bit frames]: for 2-byte elements (bf16 weights and moments, the masters'
remainders) byte planes split the exponent: bf16's high byte is the sign and seven
exponent bits, its low byte the last exponent bit and the mantissa, so the one
compressible field is cut in two and the sign sits with it. nvCOMP's ANS has a mode for
16-bit floats (``data_type="<f2"``) that models the element itself; on the bench's
trained bf16 weights it stores them smaller than byte planes do, but it stores the
streamed step's bf16 Adam moments larger (docs/benchmarks.md, 'Compression: the codec
alone'). Neither mode wins on every kind of tensor, and the engine does not know what a
frame holds, so a 2-byte frame is coded both ways (two GPU passes, each far faster than
the disk) and keeps the smaller, which stores the bf16-moment step in fewer bytes than
either mode alone. Frames of the 16-bit mode carry their own codec id
(``NVCOMP_F16_ID``), so a greenroom that predates them refuses the file in one line
instead of decoding it as planes.

Note [ANS chunks]: nvCOMP's ANS cuts its input into chunks (64 KiB by default), each
with its own frequency table, and each chunk into sub-chunks (8 by default) with their
own coder states; both cost stored bytes in every chunk. Larger chunks pay them less
often, but a chunk that straddles two byte planes codes both under one table, so a
chunk must not be larger than a plane: a quarter of a frame, the plane of a 4-byte
frame. On the bench's trained state 256 KiB chunks of 4 sub-chunks store every kind of
tensor smaller than nvCOMP's defaults, and 1 MiB chunks store fp32 planes much worse
(docs/benchmarks.md, 'Compression: the codec alone', by kind of tensor). The bitstream
records how it was cut, so the decoder is built without these options: given a sub-chunk
count smaller than the stream's, nvCOMP 6.0 decoded a payload of its defaults to wrong
bytes without an error (files written before these options must still read).

Note [batched decode]: a chunk's frames decode in one nvCOMP call per coding, into one
scratch buffer at the frames' own offsets (``out=``: nvCOMP allocates no output), and each
run of back-to-back frames of one length and element size is joined from its planes in
one kernel, as the encoder splits them. The kernels are fast; the cost lies in the
per-frame work around them, 64 times per 64 MiB chunk: an output allocation calling back
into Python, a tensor made from each nvCOMP array and one transpose launch per frame,
which at one thread halve the decoder's rate. The encoder does the same: its payloads
go into one buffer with nvCOMP's worst-case room for each, and are views of it. Batched,
both run well faster than frame by frame (docs/benchmarks.md, 'Design measurements').
Every payload is decoded from its offset in the chunk's one device copy, never copied
out frame by frame.

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
import torch

from greenroom.errors import ConfigError, IntegrityError
from greenroom.io.codec_names import MIN_COMPRESSED_CHUNK_MB, check_codec, frames_fit
from greenroom.io.integrity import EXTENT
from greenroom.units import MIB

MIN_RATIO = 1.03
"""A frame is stored compressed only when it shrinks by at least this factor."""

HEADER_BYTES = 64
"""The header before a compressed frame's payload (padded: payloads start 64-byte aligned)."""

MAGIC = b"GRZF"
_HEADER = struct.Struct("<4sBBxxII")  # magic, codec id, element size, raw bytes, payload bytes


def plane_split(frame: np.ndarray, itemsize: int) -> np.ndarray:
    """A host frame's bytes reordered into ``itemsize`` planes (Note [byte planes]; the
    device codec splits whole runs of frames in its own kernels, Note [batched decode])."""
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


class NvcompPlanes:
    """Byte planes + nvCOMP ANS on the GPU; a chunk's frames are encoded and decoded as one
    batch (one call, the frames carved from one buffer by offsets)."""

    name = "nvcomp-ans"
    id = 2
    on_device = True

    def __init__(self) -> None:
        from nvidia import nvcomp

        self._nvcomp = nvcomp
        # One codec call at a time: four I/O threads calling at once ran several times
        # slower together than one at a time (they contend for the GIL and the launch
        # path; docs/benchmarks.md, 'Design measurements'); the disk is the slower side
        # either way, and the other threads keep it busy meanwhile.
        self._lock = threading.Lock()
        self._bounds: dict[tuple[bool, int], int] = {}
        # nvCOMP's own allocator cudaMallocs and cudaFrees its scratch and outputs on every
        # call, and cudaFree waits for the whole device: the I/O threads' codec calls
        # would run one at a time. torch's caching allocator reuses the blocks, on the
        # calling thread's current stream (the I/O thread's own), so it stays stream-ordered.
        nvcomp.set_device_allocator(_TorchDeviceBlock)

    def _codec(self, stream: torch.cuda.Stream, half: bool, *, encoding: bool):
        # Bound to ``stream``: a codec keeps its scratch (more than the batch it codes:
        # docs/benchmarks.md, 'Design measurements') for as long as it lives, and a sleeping
        # actor must give every byte of it back, so an encoder lives for one call and the
        # engine drops its decoders when no read needs them (Note [kept decoders] of
        # greenroom.io.frames). The scratch comes from torch's cache, so the next codec's is a
        # reuse, not a cudaMalloc.
        options = {"data_type": "<f2"} if half else {}  # Note [16-bit frames]
        if encoding:  # a decoder takes them from the bitstream (Note [ANS chunks])
            options.update(ANS_CHUNKS)
        return self._nvcomp.Codec(
            algorithm="ANS", device_id=stream.device.index, cuda_stream=stream.cuda_stream, **options
        )

    @staticmethod
    def _offsets(sizes: list[int]) -> tuple[list[int], int]:
        # nvCOMP wants 16-byte aligned buffers; whole frames stay back to back.
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += (size + _BATCH_ALIGN - 1) // _BATCH_ALIGN * _BATCH_ALIGN
        return offsets, at

    def _bound(self, encoder, half: bool, frame: torch.Tensor) -> int:
        """The most bytes ``encoder`` may store ``frame`` in (one nvCOMP query per length)."""
        key = (half, frame.numel())
        if key not in self._bounds:
            self._bounds[key] = encoder.get_max_comp_buffer_size(self._nvcomp.as_array(frame))
        return self._bounds[key]

    def _batch(self, flat: torch.Tensor, offsets: list[int], sizes: list[int], stream):
        return self._nvcomp.as_arrays(self._nvcomp.as_array(flat), offsets, sizes, stream.cuda_stream)

    def encode(
        self, frames: list[torch.Tensor], itemsizes: list[int], stream: torch.cuda.Stream
    ) -> list[tuple[int, torch.Tensor]]:
        """The header codec id and payload (a flat uint8 device tensor) of each of the
        device ``frames``; a frame of 2-byte elements keeps the smaller of its two codings
        (Note [16-bit frames]). The stream is synchronized."""
        coded: list = [None] * len(frames)
        for two_byte, group in _by_flag([size == 2 for size in itemsizes]):
            picked = [frames[k] for k in group]
            as_planes = self._encode(picked, [itemsizes[k] for k in group], stream, half=False)
            as_half = self._encode(picked, [2] * len(group), stream, half=True) if two_byte else as_planes
            for k, planes, half in zip(group, as_planes, as_half):
                coded[k] = (NVCOMP_F16_ID, half) if two_byte and half.numel() <= planes.numel() else (self.id, planes)
        return coded

    def _encode(self, frames: list[torch.Tensor], itemsizes: list[int], stream: torch.cuda.Stream, half: bool) -> list:
        lengths = [frame.numel() for frame in frames]
        offsets, total = self._offsets(lengths)
        with self._lock, torch.cuda.stream(stream):  # nvCOMP's scratch comes from this stream's pool
            planes = torch.empty(total, dtype=torch.uint8, device=stream.device)
            for i, j in _runs(frames, itemsizes):  # one transpose kernel per run
                n, size = lengths[i], itemsizes[i]
                run = frames[i].as_strided((j - i, n), (n, 1))
                dst = planes[offsets[i] : offsets[i] + (j - i) * n].view(j - i, n)
                if size == 1 or n % size or half:
                    dst.copy_(run)
                else:
                    dst.view(j - i, size, n // size).copy_(run.view(j - i, n // size, size).transpose(1, 2))
            encoder = self._codec(stream, half, encoding=True)
            batch = self._batch(planes, offsets, lengths, stream)
            # Into one buffer, each payload at its own offset with room for the worst case
            # (Note [batched decode]); the payloads returned are views of it. Zeroed, as
            # nvCOMP's scratch is (_TorchDeviceBlock): stored bytes are a function of the
            # frame alone.
            capacities = [self._bound(encoder, half, frame) for frame in frames]
            at, size = self._offsets(capacities)
            out = torch.zeros(size, dtype=torch.uint8, device=stream.device)
            stored = encoder.encode(batch, out=self._batch(out, at, capacities, stream)).buffer_sizes
            stream.synchronize()
            return [out[start : start + n] for start, n in zip(at, stored)]

    def decode(
        self,
        packed: torch.Tensor,
        spans: list[tuple[int, int]],
        outs: list[torch.Tensor],
        layouts: list[tuple[int, int]],
        stream: torch.cuda.Stream,
        where: list[str],
        decoders: dict | None = None,
    ) -> None:
        """Decode the payloads at ``spans`` (``(offset, bytes)``, 16-byte aligned) of
        ``packed``, a chunk's stored bytes on the device, into ``outs`` (device, the
        frames' raw lengths); ``layouts`` are each frame's header codec id and element
        size. The stream is synchronized. ``decoders``, a dict the caller keeps for this
        one ``stream``, keeps nvCOMP's decoders (and their scratch) from call to call until
        the caller drops it (the engine's ``frames.KeptDecoders``); without it each call
        makes its own (Note [batched decode])."""
        with self._lock, torch.cuda.stream(stream):
            for half, group in _by_flag([codec_id == NVCOMP_F16_ID for codec_id, _ in layouts]):
                batch = self._nvcomp.as_arrays(
                    self._nvcomp.as_array(packed),
                    [spans[k][0] for k in group],
                    [spans[k][1] for k in group],
                    stream.cuda_stream,
                )
                targets = [outs[k] for k in group]
                offsets, total = self._offsets([out.numel() for out in targets])
                planes = torch.empty(total, dtype=torch.uint8, device=stream.device)
                if decoders is None:
                    decoder = self._codec(stream, half, encoding=False)
                elif half in decoders:
                    decoder = decoders[half]
                else:
                    decoder = decoders[half] = self._codec(stream, half, encoding=False)
                try:
                    sizes = decoder.decode(
                        batch, out=self._batch(planes, offsets, [out.numel() for out in targets], stream)
                    ).buffer_sizes
                except Exception as e:  # nvCOMP reports a stream it cannot parse as a RuntimeError or ValueError
                    raise IntegrityError(
                        f"{where[group[0]]}: a compressed frame does not decode ({e}): a flipped "
                        "bit, a failing disk or a stray write; stopped before using it: restart "
                        "from the last checkpoint"
                    ) from None
                for size, out, k in zip(sizes, targets, group):
                    if size != out.numel():
                        raise IntegrityError(
                            f"{where[k]}: the compressed frame decodes to {size} bytes, expected "
                            f"{out.numel()}; stopped before using it: restart from the last "
                            "checkpoint"
                        )
                itemsizes = [1 if half else layouts[k][1] for k in group]
                for i, j in _runs(targets, itemsizes):  # one transpose kernel per run
                    n, size = targets[i].numel(), itemsizes[i]
                    run = planes[offsets[i] : offsets[i] + (j - i) * n].view(j - i, n)
                    dst = targets[i].as_strided((j - i, n), (n, 1))
                    if size == 1 or n % size:
                        dst.copy_(run)
                    else:
                        dst.view(j - i, n // size, size).copy_(run.view(j - i, size, n // size).transpose(1, 2))
            stream.synchronize()


def _runs(frames: list[torch.Tensor], itemsizes: list[int]):
    """``(i, j)`` for each run ``frames[i:j]`` of byte tensors that lie back to back in one
    storage, of one length (a multiple of the batch alignment) and element size: their
    planes move in one kernel (a 64 MiB chunk is 64 one-MiB frames)."""
    i = 0
    while i < len(frames):
        n, size, j = frames[i].numel(), itemsizes[i], i + 1
        storage = frames[i].untyped_storage().data_ptr()
        while (
            j < len(frames)
            and n % _BATCH_ALIGN == 0
            and frames[j].numel() == n
            and itemsizes[j] == size
            and frames[j].data_ptr() == frames[j - 1].data_ptr() + n
            and frames[j].untyped_storage().data_ptr() == storage
        ):
            j += 1
        yield i, j
        i = j


def _by_flag(flags: list[bool]) -> list[tuple[bool, list[int]]]:
    """The indices of ``flags`` grouped by their flag, False first, each group in order;
    the empty ones left out (frames of one nvCOMP call: Note [16-bit frames])."""
    groups = ((flag, [k for k, f in enumerate(flags) if f == flag]) for flag in (False, True))
    return [(flag, group) for flag, group in groups if group]


# Stored bytes per raw byte expected on a trained model's state, per kind of tensor: what
# ``greenroom plan`` reports. nvcomp-ans: a 207M-param Llama after 5 AdamW steps (byte
# planes, nvCOMP's default chunks; Note [ANS chunks] stores a little less), except bf16
# weights: the offload bench's trained actor (Note [16-bit frames], Note [ANS chunks];
# docs/benchmarks.md, 'Actor offload'); zstd: a 2-layer MLP after 20 AdamW steps. Kinds
# not measured count as incompressible.
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


_BATCH_ALIGN = 256

ANS_CHUNKS = {"uncomp_chunk_size": EXTENT // 4, "max_sub_chunk_count": 4}
"""How nvCOMP's ANS encoder cuts a frame (Note [ANS chunks])."""

NVCOMP_F16_ID = 3
"""The header codec id of an ``nvcomp-ans`` frame coded in nvCOMP's 16-bit float mode."""


class _TorchDeviceBlock:
    """Device memory for nvCOMP from torch's caching allocator (``ptr`` is what it reads),
    zeroed: nvCOMP's ANS encoder carries bytes of its scratch into the payloads it writes.
    Unzeroed, the same frames encoded twice gave payloads that differed (each still
    decoding exactly); zeroed, every encode matched (docs/benchmarks.md, 'Design
    measurements'). A stored file must be a function of the state it holds (a retried
    write, a checkpoint written twice), and the memset runs at the device's memory rate,
    far above the encoder's."""

    __slots__ = ("tensor", "ptr")

    def __init__(self, nbytes: int, stream=None) -> None:
        self.tensor = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device="cuda")
        self.ptr = self.tensor.data_ptr()


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
