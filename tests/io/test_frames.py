"""The on-disk layout of compressed transfers (greenroom.io.frames, and Note [compact
transfers] of greenroom.io.frame_layout), on the host codec: damaged records refused, frames
packed from a transfer's start, readers of any staging size, files of the earlier layout,
``MAX_SHIFT``, failed chunks, and a unit rewritten alone. Every round trip is compared
with ``torch.equal`` on the bytes.
"""

import os

import pytest
import torch

from greenroom.errors import ConfigError, IntegrityError
from greenroom.io import compression, frame_layout
from greenroom.io.engine import EXTENT, StateFile, TransferEngine, align_up
from tests.io.codec_support import CHUNK, as_bytes, compressible, zstd

__all__ = ["zstd"]  # the fixture, imported for the tests below


def _patch(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_a_damaged_stored_size_or_shift_record_and_an_unknown_codec_are_refused(tmp_path, zstd):
    # A bucket-style file (its table in it): the record of frame 0's stored bytes is
    # overwritten with more than the frame holds; then, restored, frame 1's shift is made
    # to point into frame 0's stored bytes; then, restored, the header names a codec this
    # greenroom does not know. Each read stops in one line naming the file.
    t = compressible(torch.float32, 2 * EXTENT // 4)
    path = str(tmp_path / "bucket")
    with (
        StateFile(path, t.numel() * 4, checksums="file", compression=zstd) as f,
        TransferEngine(CHUNK, verify=False) as engine,
    ):
        engine.write(t, f, 0).wait()
        record = f.table_offset + 2 * 8  # after the two extents' sums
        with open(path, "rb") as raw:
            raw.seek(record)
            saved = raw.read(4)
        _patch(path, record, (EXTENT + 5).to_bytes(4, "little"))
        with pytest.raises(IntegrityError, match="the record is damaged") as err:
            engine.read(torch.empty_like(t), f, 0).wait()
        assert path in str(err.value) and "\n" not in str(err.value)
        _patch(path, record, saved)
        shift_of_second = record + 8 + 4  # after frame 0's pair and frame 1's stored bytes
        with open(path, "rb") as raw:
            raw.seek(shift_of_second)
            saved = raw.read(4)
        _patch(path, shift_of_second, EXTENT.to_bytes(4, "little"))
        with pytest.raises(IntegrityError, match="the record is damaged") as err:
            engine.read(torch.empty_like(t), f, 0).wait()
        assert path in str(err.value) and "\n" not in str(err.value)
        _patch(path, shift_of_second, saved)
        _patch(path, 4, bytes([9]))  # the header's codec id
        with pytest.raises(IntegrityError, match="names codec 9") as err:
            engine.read(torch.empty_like(t), f, 0).wait()
        assert path in str(err.value) and "\n" not in str(err.value)
        back = torch.empty_like(t)
        _patch(path, 4, bytes([compression.ZstdPlanes.id]))
        engine.read(back, f, 0).wait()  # the file itself was never changed by the refusals
    assert torch.equal(as_bytes(back), as_bytes(t))


def _count_writes(monkeypatch) -> list:
    calls = []
    original = StateFile.write

    def counted(self, buf, file_offset):
        calls.append((file_offset, len(buf)))
        return original(self, buf, file_offset)

    monkeypatch.setattr(StateFile, "write", counted)
    return calls


def test_a_transfers_frames_are_packed_from_its_start_and_each_chunk_moves_in_one_io(tmp_path, zstd, monkeypatch):
    # Compressible and incompressible frames mixed in each chunk: raw frames after
    # compressed ones move back, compressed ones after raw ones follow them; each chunk is
    # one write of its stored bytes, right after the previous chunk's (Note [compact
    # transfers]), and every byte comes back.
    g = torch.Generator().manual_seed(5)
    frames = [
        compressible(torch.uint8, EXTENT, k)
        if k % 3
        else torch.randint(0, 256, (EXTENT,), dtype=torch.uint8, generator=g)
        for k in range(7)
    ]
    t = torch.cat(frames + [compressible(torch.uint8, 5000, 9)])
    calls = _count_writes(monkeypatch)
    with StateFile(str(tmp_path / "state"), t.numel(), compression=zstd) as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        record = f.recorded(0, align_up(t.numel()))[1].tolist()
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
    assert torch.equal(back, t)
    places = [k * EXTENT - shift for k, (_, shift) in enumerate(record)]
    ends = [place + align_up(n) for place, (n, _) in zip(places, record)]
    assert places == [0] + ends[:-1]  # one run from the transfer's start, no gaps
    assert record[0][0] == EXTENT and record[1][0] < EXTENT  # a raw frame, then a compressed one
    # Two frames per staging buffer (CHUNK // 4): one write per chunk, of both frames' pages.
    assert sorted(calls) == [
        (places[k], ends[min(k + 1, len(record) - 1)] - places[k]) for k in range(0, len(record), 2)
    ]


def test_a_reader_with_smaller_or_larger_staging_than_the_writer_reads_every_byte(tmp_path, zstd):
    """Written with an 8 MiB chunk, read with 16 and 4: a read places its chunks' stored
    bytes back to back in its own buffers (Note [packed frames]), so any staging of at least
    one frame per buffer reads the file, one smaller than the writer's chunk too. Under one
    frame per buffer it is refused in one line."""
    t = compressible(torch.float32, 4 * EXTENT // 4)
    path = str(tmp_path / "bucket")
    with StateFile(path, t.numel() * 4, checksums="file", compression=zstd) as f:
        with TransferEngine(CHUNK) as engine:
            engine.write(t, f, 0).wait()
        for chunk in (2 * CHUNK, CHUNK // 2):
            back = torch.empty_like(t)
            with TransferEngine(chunk) as engine:
                engine.read(back, f, 0).wait()
            assert torch.equal(as_bytes(back), as_bytes(t)), chunk
        with (
            TransferEngine(CHUNK // 4) as engine,
            pytest.raises(ConfigError, match=r"compression needs staging buffers of at least 1 MiB") as err,
        ):
            engine.read(back, f, 0).wait()
    assert path in str(err.value) and "--offload-train-disk-chunk-mb" in str(err.value) and "\n" not in str(err.value)


def _chunk_starts(record: list, step: int) -> list:
    """The frames a writer's chunk began with (two 1 MiB frames per 2 MiB buffer) and where
    their stored bytes start relative to their own place (0: at it)."""
    return [shift for k, (_, shift) in enumerate(record) if k * EXTENT % step == 0]


def test_a_file_of_chunks_stored_at_their_own_places_still_reads(tmp_path, zstd, monkeypatch):
    # The layout before compact transfers (Note [compact transfers] of
    # greenroom.io.frame_layout): every chunk's frames from the chunk's own place, a gap
    # after each. MAX_SHIFT 0 writes exactly that; a reader of any staging size reads it
    # back (files and checkpoints of earlier runs).
    t = compressible(torch.bfloat16, 7 * EXTENT // 2 + 1234)
    monkeypatch.setattr(frame_layout, "MAX_SHIFT", 0)
    with StateFile(str(tmp_path / "state"), t.numel() * 2, compression=zstd, checksums="file") as f:
        with TransferEngine(CHUNK) as engine:
            engine.write(t, f, 0).wait()
        record = f.recorded(0, align_up(t.numel() * 2))[1].tolist()
        assert _chunk_starts(record, CHUNK // 4) == [0] * 4 and any(shift for _, shift in record)
        monkeypatch.undo()
        for chunk in (CHUNK // 2, CHUNK, 4 * CHUNK):
            back = torch.empty_like(t)
            with TransferEngine(chunk) as engine:
                engine.read(back, f, 0).wait()
            assert torch.equal(as_bytes(back), as_bytes(t)), chunk


def test_a_chunk_is_stored_at_its_own_place_where_its_shift_would_pass_max_shift(tmp_path, zstd, monkeypatch):
    t = compressible(torch.float32, 12 * EXTENT // 4)
    monkeypatch.setattr(frame_layout, "MAX_SHIFT", 3 * EXTENT)
    with StateFile(str(tmp_path / "state"), t.numel() * 4, compression=zstd) as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        record = f.recorded(0, t.numel() * 4)[1].tolist()
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
    assert torch.equal(as_bytes(back), as_bytes(t))
    assert max(shift for _, shift in record) <= 3 * EXTENT
    starts = _chunk_starts(record, CHUNK // 4)
    assert starts[0] == 0 and 0 in starts[1:] and any(starts)  # compacted, then restarted at its own place


@pytest.mark.parametrize("failing", ["encode", "write"])
def test_a_failed_chunk_fails_the_transfer_and_the_chunks_after_it_are_still_placed(
    tmp_path, zstd, monkeypatch, failing
):
    # Each chunk is placed after the one before it (frame_layout.Placement); a chunk that
    # fails before it is placed (its encode) or after (its write) still hands the place on,
    # so the transfer fails with its error instead of hanging, and the engine writes and
    # reads on.
    t = compressible(torch.float32, 8 * EXTENT // 4)
    owner = StateFile if failing == "write" else type(zstd)
    real, calls = getattr(owner, failing), []

    def fails_once(self, *args):
        calls.append(args)
        if len(calls) == 3:  # the second chunk's first frame (encode) or the third chunk (write)
            raise OSError(28, "No space left on device")
        return real(self, *args)

    with StateFile(str(tmp_path / "state"), t.numel() * 4, compression=zstd) as f, TransferEngine(CHUNK) as engine:
        monkeypatch.setattr(owner, failing, fails_once)
        with pytest.raises(OSError, match="No space left on device"):
            engine.write(t, f, 0).wait()
        monkeypatch.setattr(owner, failing, real)
        engine.write(t, f, 0).wait()
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
    assert torch.equal(as_bytes(back), as_bytes(t))


def test_a_unit_rewritten_with_a_new_stored_size_leaves_its_neighbours_bytes(tmp_path, zstd):
    # Note [compact transfers] of greenroom.io.frame_layout: each unit's stored bytes start
    # at its slot and stay inside it, so the middle unit going from compressible to
    # incompressible (its stored bytes grow by half) and back, rewritten alone while its
    # clean neighbours are skipped, never touches theirs.
    from greenroom.actor.movers import DiskMover
    from greenroom.actor.tracking import Tracked

    tensors = [compressible(torch.bfloat16, 3 * EXTENT // 2 + 2048 * k, seed=k) for k in range(3)]
    units = [Tracked(storage=t.untyped_storage(), nbytes=t.numel() * 2, key=("unit", k)) for k, t in enumerate(tensors)]
    kept = [t.clone() for t in tensors]
    noise = torch.randint(-(2**15), 2**15, (tensors[1].numel(),), dtype=torch.int16).view(torch.bfloat16)
    mover = DiskMover(str(tmp_path), CHUNK, skip_clean=True, compression=zstd)
    try:
        for sleep, middle in enumerate((noise, kept[1] + 1, noise)):
            tensors[1].copy_(middle)
            moved = mover.save(units)
            assert moved.clean == (0 if sleep == 0 else units[0].nbytes + units[2].nbytes)
            for t in tensors:
                t.zero_()
            mover.restore(units)
            for k in (0, 2):  # the skipped neighbours
                assert torch.equal(as_bytes(tensors[k]), as_bytes(kept[k])), k
            assert torch.equal(as_bytes(tensors[1]), as_bytes(middle))
    finally:
        mover.close()


def _record_at(f: StateFile, extent: int) -> int:
    """The file offset of extent ``extent``'s record (its frame's stored bytes, then its shift)."""
    return f.table_offset + (f.data_bytes + EXTENT - 1) // EXTENT * 8 + 8 * extent


@pytest.mark.parametrize("where", ["table", "table, the field's other bits kept", "memory"])
def test_a_record_rewritten_to_stored_raw_over_a_zero_tail_is_caught(tmp_path, zstd, where):
    # The case of docs/reliability.md section 6 that range and header checks miss: the last
    # frame's record says "stored raw" (exactly its raw length), and the pages after its
    # stored bytes are the zeros of a fresh file, which add nothing to a sum of pages.
    # The header would then be read back as data; the record is summed with its extent
    # (Note [summed records] of greenroom.io.statefile), so the read stops instead. In the
    # table of a bucket file (the length written over the whole field, or only over its
    # low bits), and in the engine's memory for an offload file.
    t = compressible(torch.float32, 2 * EXTENT // 4)
    path = str(tmp_path / "state")
    with (
        StateFile(path, t.numel() * 4, checksums="memory" if where == "memory" else "file", compression=zstd) as f,
        TransferEngine(CHUNK) as engine,
    ):
        engine.write(t, f, 0).wait()
        (_, _), (second, _) = f.recorded(0, t.numel() * 4)[1].tolist()
        assert second < EXTENT  # compressed, followed by zero pages up to its own place's end
        if where == "memory":
            f._stored[(0, t.numel() * 4)][1, 0] = EXTENT
        else:
            at = _record_at(f, 1)
            with open(path, "rb") as raw:
                raw.seek(at)
                field = int.from_bytes(raw.read(4), "little")
            _patch(path, at, (EXTENT if where == "table" else field & ~(2 * EXTENT - 1) | EXTENT).to_bytes(4, "little"))
        back = torch.empty_like(t)
        with pytest.raises(IntegrityError) as err:
            engine.read(back, f, 0).wait()
    message = str(err.value)
    assert path in message and f"offset {EXTENT}" in message and "\n" not in message


def test_a_flipped_bit_in_a_record_is_caught_by_reads_and_by_checks_of_the_sums_alone(tmp_path, zstd):
    # Every bit of a compressed frame's record and of a raw frame's, flipped in turn. A
    # read refuses each (the record's range, the header, or the sum). The checks that
    # compare sums alone (a checkpoint's load and save: ``verify_against_table``) refuse it
    # too: the sum covers the stored length, so a length that still covers the same pages
    # does not pass.
    from greenroom.optim.checkpoint.checks import verify_against_table

    g = torch.Generator().manual_seed(7)
    t = torch.cat(
        [compressible(torch.uint8, EXTENT, 1), torch.randint(0, 256, (EXTENT,), dtype=torch.uint8, generator=g)]
    )
    path = str(tmp_path / "bucket")
    with StateFile(path, t.numel(), checksums="file", compression=zstd) as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        assert [n < EXTENT for n, _ in f.recorded(0, t.numel())[1].tolist()] == [True, False]
        for extent in (0, 1):
            at = _record_at(f, extent)
            with open(path, "rb") as raw:
                raw.seek(at)
                saved = raw.read(8)
            for bit in range(64):
                flipped = (int.from_bytes(saved, "little") ^ (1 << bit)).to_bytes(8, "little")
                _patch(path, at, flipped)
                with pytest.raises(IntegrityError) as err:
                    engine.read(torch.empty_like(t), f, 0).wait()
                assert path in str(err.value), (extent, bit)
                with pytest.raises(IntegrityError):
                    verify_against_table(f)
                _patch(path, at, saved)
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
        verify_against_table(f)
    assert torch.equal(back, t)


def test_a_file_of_the_earlier_table_still_reads_bit_exact(tmp_path, zstd):
    # A table as greenroom wrote it before records were summed: each extent's sum of its
    # frame's stored bytes alone, and the records as they are. Made by hand here from the
    # file's bytes, so it does not depend on the code that writes the current table; the
    # file and every checkpoint of such files must still read, and verify, as they are.
    from greenroom.io.integrity import page_sums
    from greenroom.optim.checkpoint.checks import verify_against_table

    g = torch.Generator().manual_seed(8)
    t = torch.cat(
        [
            compressible(torch.bfloat16, EXTENT, 2).view(torch.uint8),
            torch.randint(0, 256, (EXTENT,), dtype=torch.uint8, generator=g),
            compressible(torch.uint8, 5000, 3),
        ]
    )
    path = str(tmp_path / "bucket")
    with StateFile(path, t.numel(), checksums="file", compression=zstd) as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        records = f.recorded(0, f.data_bytes)[1].tolist()
    with open(path, "rb") as raw:
        data = torch.frombuffer(bytearray(raw.read(f.data_bytes)), dtype=torch.uint8)
    sums = []
    for k, (n, shift) in enumerate(records):
        at = k * EXTENT - shift
        sums.append(int(page_sums(data[at : at + align_up(n)], at).sum()))
    table = torch.zeros(StateFile.table_bytes(t.numel(), compressed=True), dtype=torch.uint8)
    table[: 8 * len(sums)].view(torch.int64).copy_(torch.tensor(sums, dtype=torch.int64))
    table[8 * len(sums) : 16 * len(sums)].view(torch.int32).copy_(torch.tensor(records, dtype=torch.int32).view(-1))
    _patch(path, f.table_offset, table.numpy().tobytes())
    with (
        StateFile(path, t.numel(), create=False, checksums="file", compression=zstd) as f,
        TransferEngine(CHUNK) as engine,
    ):
        verify_against_table(f)
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
    assert torch.equal(back, t)
