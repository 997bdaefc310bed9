"""``nvcomp-ans``, the device frame codec of ``greenroom.io.compression``: byte planes
(Note [byte planes] of ``greenroom.io.compression``) and nvCOMP's ANS on the GPU, a
chunk's frames coded in one batch.

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
"""

from __future__ import annotations

import threading

import torch

from greenroom.errors import IntegrityError
from greenroom.io.integrity import EXTENT

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
        # greenroom.io.kept_decoders). The scratch comes from torch's cache, so the next codec's is a
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
        the caller drops it (the engine's ``kept_decoders.KeptDecoders``); without it each call
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
