"""Every byte read back is verified (io.engine Note [integrity]) and every engine error reaches
the caller (Note [failing fast]): the hash itself, flipped bytes in a live bucket file and
in the actor's offload file (pages dropped, O_DIRECT where the filesystem has it), a
checkpoint round trip that carries the checksums, and errors injected into the driver
and the last chunk's bookkeeping, each under a watchdog so a hang fails the test."""

import os
import random

import pytest
import torch

from greenroom.actor.offloader import PortableOffloader
from greenroom.errors import IntegrityError, StorageError
from greenroom.io.engine import ALIGNMENT, EXTENT, StateFile, TransferEngine, extent_sums, page_sums
from greenroom.optim import StreamingAdam

MASK = (1 << 64) - 1


def flip_byte(path: str, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` behind greenroom's back, and drop the file's
    cached pages so the next read comes from the disk."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x10]), offset)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_page_sums_match_the_definition_mod_2_64():
    from greenroom.io.integrity import _LANES, _PAGE_A, _PAGE_B

    buf = torch.randint(0, 256, (3 * ALIGNMENT,), dtype=torch.uint8)
    got = page_sums(buf, 5 * ALIGNMENT)
    words = buf.view(torch.int64).tolist()
    lanes = _LANES.tolist()
    for p in range(3):
        lane_sum = sum(w * lanes[j] for j, w in enumerate(words[p * 512 : (p + 1) * 512]))
        factor = (((5 + p) * _PAGE_A + _PAGE_B) & MASK) | 1
        assert got[p].item() & MASK == (lane_sum * factor) & MASK


def test_every_single_bit_flip_changes_the_sum_and_chunking_does_not():
    rng = random.Random(0)
    buf = torch.randint(0, 256, (2 * EXTENT + 3 * ALIGNMENT,), dtype=torch.uint8)
    whole = extent_sums(buf, EXTENT)
    # Any split into 4 KiB-aligned pieces adds up to the same extent sums (the hash is linear).
    pieces = torch.zeros_like(whole)
    for start, end in ((0, 5 * ALIGNMENT), (5 * ALIGNMENT, EXTENT + ALIGNMENT), (EXTENT + ALIGNMENT, buf.numel())):
        part = extent_sums(buf[start:end], EXTENT + start)
        first = (EXTENT + start) // EXTENT - 1
        pieces[first : first + part.numel()] += part
    assert torch.equal(whole, pieces)
    for _ in range(40):
        byte, bit = rng.randrange(buf.numel()), rng.randrange(8)
        buf[byte] ^= 1 << bit
        assert not torch.equal(extent_sums(buf, EXTENT), whole), (byte, bit)
        buf[byte] ^= 1 << bit


@pytest.fixture(params=[None, False], ids=["o_direct_if_possible", "buffered"])
def direct(request):
    return request.param


@pytest.mark.timeout(120)
def test_a_flipped_byte_in_a_state_file_fails_the_read_naming_file_offset_and_state(disk_dir, direct):
    path = os.path.join(disk_dir, "state")
    src = torch.randint(0, 256, (3 * EXTENT + 1000,), dtype=torch.uint8)
    with (
        TransferEngine(256 * 1024, verify=True) as engine,
        StateFile(path, 4096 + src.numel(), direct=direct, label="the actor's offload file") as f,
    ):
        engine.write(src, f, 4096).wait()
        back = torch.empty_like(src)
        engine.read(back, f, 4096).wait()
        assert torch.equal(back, src)
        flip_byte(path, 4096 + 2 * EXTENT + 77)
        with pytest.raises(IntegrityError) as e:
            engine.read(back, f, 4096).wait()
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(
            f"{path}: checksum mismatch at offset {2 * EXTENT} "
            f"(bytes [{2 * EXTENT}, {3 * EXTENT}) of the actor's offload file)"
        )
        engine.drain()  # the error was seen once: drain does not raise it again


def test_a_range_never_written_cannot_be_read_as_verified(disk_dir):
    with TransferEngine(1 << 16) as engine, StateFile(os.path.join(disk_dir, "fresh"), 1 << 16) as f:
        with pytest.raises(IntegrityError, match=r"fresh: no checksum for bytes \[0, 65536\) of a state file"):
            engine.read(torch.empty(1 << 16, dtype=torch.uint8), f, 0).wait()


def test_verification_switch(monkeypatch, disk_dir):
    monkeypatch.setenv("GREENROOM_VERIFY", "0")
    path = os.path.join(disk_dir, "unverified")
    with TransferEngine(1 << 16) as engine, StateFile(path, 1 << 16) as f:
        assert not engine.verify
        src = torch.ones(1 << 16, dtype=torch.uint8)
        engine.write(src, f, 0).wait()
        flip_byte(path, 10)
        back = torch.empty_like(src)
        engine.read(back, f, 0).wait()  # measurement only: nothing checks
        assert back[10] == 1 ^ 0x10
    monkeypatch.setenv("GREENROOM_VERIFY", "yes")
    with pytest.raises(ValueError, match=r"GREENROOM_VERIFY='yes': expected 1 .* or 0"):
        TransferEngine(1 << 16)


def _streaming_adam(disk_dir, n_params=4, numel=300_000):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, dtype=torch.bfloat16)) for _ in range(n_params)]
    opt = StreamingAdam(
        params, lr=1e-3, state_dir=os.path.join(disk_dir, "optim"), bucket_numel=numel, chunk_mb=1, resident_numel=0
    )
    for p in params:
        p.grad = torch.randn_like(p)
    return params, opt


@pytest.mark.timeout(120)
def test_a_flipped_byte_in_a_bucket_file_stops_the_step_before_the_bucket_is_used(disk_dir):
    params, opt = _streaming_adam(disk_dir)
    try:
        opt.step()
        bucket = opt.store.buckets[2]
        flipped = bucket.exp_avg.offset + 4 * 1234
        flip_byte(opt.store.path(2), flipped)
        before = [p.detach().clone() for p in params]
        with pytest.raises(IntegrityError) as e:
            opt.step()
        message = str(e.value)
        extent = flipped // EXTENT * EXTENT  # the checksummed extent that holds the flipped byte
        assert message.startswith(f"{opt.store.path(2)}: checksum mismatch at offset {extent} (bytes [{extent}, ")
        assert "of bucket 2 of the optimizer state)" in message
        # Bucket 3, which the first step kept on the device (optim.store.held Note [the last
        # bucket stays]), and buckets 0 and 1 were stepped; bucket 2's params never saw the bad moment.
        assert torch.equal(params[2], before[2])
        assert not any(torch.equal(params[i], before[i]) for i in (0, 1, 3))
    finally:
        opt.close()


def test_a_flipped_byte_is_caught_by_state_dict_before_it_is_saved(disk_dir):
    # state_dict() hands out views of the bucket files, read around the I/O engine.
    params, opt = _streaming_adam(disk_dir)
    try:
        opt.step()
        bucket = opt.store.buckets[1]
        flip_byte(opt.store.path(1), bucket.exp_avg_sq.offset + 4 * 77)
        with pytest.raises(IntegrityError, match="of bucket 1 of the optimizer state"):
            opt.state_dict()
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_a_flipped_checksum_table_is_caught_too(disk_dir):
    params, opt = _streaming_adam(disk_dir, n_params=1)
    try:
        flip_byte(opt.store.path(0), opt.store.buckets[0].data_bytes + 3)
        with pytest.raises(IntegrityError, match="checksum mismatch at offset 0 .* of bucket 0 of the optimizer"):
            opt.step()
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_checkpoint_round_trip_carries_the_checksums(disk_dir):
    params, opt = _streaming_adam(disk_dir)
    try:
        opt.step()
        ckpt = os.path.join(disk_dir, "ckpt")
        opt.save_checkpoint(ckpt)
        opt.step()
        opt.load_checkpoint(ckpt)  # the live files now hold the checkpoint's bytes and tables
        opt.step()
        flip_byte(opt.store.path(1), 8)
        with pytest.raises(IntegrityError, match="bucket 1 of the optimizer state"):
            opt.step()
    finally:
        opt.close()


@pytest.mark.timeout(120)
def test_a_flipped_byte_in_the_actor_offload_file_fails_the_wake(disk_dir):
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    offloader = PortableOffloader(target="disk", offload_dir=disk_dir, chunk_bytes=1 << 20).track(model)
    try:
        offloader.sleep()
        flip_byte(os.path.join(disk_dir, "actor.state"), 100)
        with pytest.raises(
            IntegrityError,
            match=r"actor\.state: checksum mismatch at offset 0 \(bytes \[0, .*\) of "
            r"the actor's offload file\)",
        ):
            offloader.wake()
    finally:
        offloader.close()


# -- Note [failing fast] -------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_an_error_in_the_driver_thread_reaches_wait_drain_and_close(disk_dir, monkeypatch):
    engine = TransferEngine(1 << 16)
    f = StateFile(os.path.join(disk_dir, "driver"), 1 << 20)

    def broken(*args):
        raise RuntimeError("staging copy failed")

    monkeypatch.setattr(engine, "_stage_out", broken)
    first = engine.write(torch.ones(1 << 20, dtype=torch.uint8), f, 0)  # 16 chunks, none handed out
    second = engine.write(torch.ones(1 << 20, dtype=torch.uint8), f, 0)
    with pytest.raises(RuntimeError, match="staging copy failed"):
        first.wait()
    with pytest.raises(RuntimeError, match="staging copy failed"):
        engine.drain()  # the second transfer's error, not yet seen by anyone
    monkeypatch.undo()
    engine.write(torch.ones(1 << 16, dtype=torch.uint8), f, 0).wait()  # the engine still works
    f.close()  # before the write, or the write could finish first and fail nothing
    third = engine.write(torch.ones(1 << 16, dtype=torch.uint8), f, 0)
    with pytest.raises(StorageError, match="EBADF"):
        engine.close()
    assert third.done() and second.done()


@pytest.mark.timeout(60)
def test_an_error_recording_the_checksums_reaches_wait(disk_dir, monkeypatch):
    with TransferEngine(1 << 16) as engine, StateFile(os.path.join(disk_dir, "seal"), 1 << 20) as f:

        def broken(*args):
            raise StorageError("table write failed")

        monkeypatch.setattr(f, "record_sums", broken)
        with pytest.raises(StorageError, match="table write failed"):
            engine.write(torch.ones(1 << 20, dtype=torch.uint8), f, 0).wait()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_transfers_are_verified_too(disk_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    path = os.path.join(disk_dir, "gpu-state")
    src = torch.randint(0, 256, (2 * EXTENT + 5,), dtype=torch.uint8, device="cuda")
    with TransferEngine(1 << 20) as engine, StateFile(path, src.numel(), label="the actor's offload file") as f:
        engine.write(src, f, 0).wait()
        back = torch.zeros_like(src)
        engine.read(back, f, 0).wait()
        assert torch.equal(back, src)
        flip_byte(path, EXTENT + 1)
        with pytest.raises(IntegrityError, match=f"checksum mismatch at offset {EXTENT} "):
            engine.read(back, f, 0).wait()


def test_the_device_form_of_the_sums_is_the_host_form_to_the_bit():
    # Note [sums on the device]: CUDA takes the sums as a product and a sum per slice of
    # pages; the host as a mat-vec. Words at the extremes make every product wrap.
    from greenroom.io.integrity import _LANES, _PAGES_PER_PRODUCT, _sliced_lane_dot

    generator = torch.Generator().manual_seed(7)
    words = torch.randint(
        -(1 << 63), (1 << 63) - 1, (_PAGES_PER_PRODUCT + 3, 512), dtype=torch.int64, generator=generator
    )
    words[0] = -(1 << 63)
    words[1] = (1 << 63) - 1
    assert torch.equal(_sliced_lane_dot(words, _LANES), words @ _LANES)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_sums_taken_on_the_device_match_the_hosts():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    from greenroom.io.integrity import _PAGES_PER_PRODUCT

    host = torch.randint(0, 256, ((_PAGES_PER_PRODUCT + 5) * ALIGNMENT,), dtype=torch.uint8)
    for offset in (0, 7 * ALIGNMENT, 3 * EXTENT):
        assert torch.equal(page_sums(host.cuda(), offset).cpu(), page_sums(host, offset))
