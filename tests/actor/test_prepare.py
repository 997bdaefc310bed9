"""``Offloader.prepare``: the disk target's file is made, preallocated and written once
before the first sleep, so no sleep pays the disk's first write to its blocks
(``greenroom.io.statefile`` Note [backed blocks]), and the staging buffers are faulted in.

What is pinned: after ``prepare()`` the file holds the whole actor and no extent of it is
unwritten (FIEMAP, the kernel's own map of the file); the first sleep then neither
preallocates nor writes a byte beyond the actor's; bytes an earlier sleep left in place
are never overwritten by a later ``prepare()``; no room is refused at ``prepare()`` in one
line with nothing left behind; a failed fill removes the file it made.
"""

import array
import errno
import fcntl
import os
import struct
import subprocess

import pytest
import torch

from greenroom import OffloadConfig, actor
from greenroom.actor.movers import STATE_FILE
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import GreenroomError, StorageError
from greenroom.io.integrity import align_up

MIB = 1 << 20
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNWRITTEN = 0x800
_HEADER = struct.Struct("=QQIIII")  # struct fiemap, before its extents
_EXTENT = struct.Struct("=QQQQQIIII")  # struct fiemap_extent


def extents(path: str) -> list[tuple[int, int, int]]:
    """``(logical offset, length, flags)`` of every extent of ``path``, from the kernel."""
    out, start, count = [], 0, 64
    with open(path, "rb") as f:
        while True:
            buf = bytearray(_HEADER.size + count * _EXTENT.size)
            _HEADER.pack_into(buf, 0, start, (1 << 64) - 1 - start, FIEMAP_FLAG_SYNC, 0, count, 0)
            raw = array.array("B", buf)
            try:
                fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, raw, True)
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL):
                    pytest.skip(f"the filesystem under {path} has no FIEMAP")
                raise
            mapped = _HEADER.unpack_from(raw, 0)[3]
            if not mapped:
                return out
            for i in range(mapped):
                logical, _, length, *_, flags, _, _, _ = _EXTENT.unpack_from(raw, _HEADER.size + i * _EXTENT.size)
                out.append((logical, length, flags))
            if out[-1][2] & FIEMAP_EXTENT_LAST:
                return out
            start = out[-1][0] + out[-1][1]


def config(disk_dir, **kw):
    return OffloadConfig(
        **{
            "offload_train": True,
            "offload_train_target": "disk",
            "offload_train_disk_dir": disk_dir,
            "offload_train_disk_chunk_mb": 4,
            **kw,
        }
    )


def actor_tensors():
    torch.manual_seed(0)
    return [torch.randn(3 * MIB // 4), torch.randn(MIB // 4 + 5), torch.randint(0, 256, (2 * MIB,), dtype=torch.uint8)]


def count_fallocate(monkeypatch) -> list:
    calls = []
    real = os.posix_fallocate

    def spy(fd, offset, length):
        calls.append(length)
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", spy)
    return calls


def test_prepare_makes_the_whole_file_written_before_the_first_sleep(disk_dir, monkeypatch):
    tensors = actor_tensors()
    expected = [t.clone() for t in tensors]
    need = sum(align_up(t.nbytes) for t in tensors)
    with (
        RankDir(disk_dir, job="t") as rank_dir,
        actor.build_offloader(config(disk_dir), rank_dir, scope="tracked") as off,
    ):
        off.track(tensors)
        path = os.path.join(rank_dir.path, "offload", STATE_FILE)
        assert not os.path.exists(path)
        prepared = off.prepare()
        assert prepared.nbytes == sum(t.nbytes for t in tensors) and prepared.written == need
        assert os.path.getsize(path) == need
        mapped = extents(path)
        assert sum(length for _, length, _ in mapped) >= need  # every block allocated
        assert not [e for e in mapped if e[2] & FIEMAP_EXTENT_UNWRITTEN], mapped  # and written once
        # The first sleep finds the file whole: no preallocation, and only the actor's bytes written.
        fallocated = count_fallocate(monkeypatch)
        slept = off.sleep()
        assert fallocated == []
        assert slept.copied == sum(t.nbytes for t in tensors)
        # The zeros, then the actor's slots (each padded to 4 KiB, Note [alignment]), nothing more.
        assert off.disk_bytes("written") == 2 * need
        assert os.path.getsize(path) == need
        off.wake()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


def test_without_prepare_the_first_sleep_makes_the_file_itself(disk_dir, monkeypatch):
    """prepare() is optional: a sleep without it preallocates the file as it always did."""
    tensors = actor_tensors()
    expected = [t.clone() for t in tensors]
    with RankDir(disk_dir, job="t") as rank_dir:
        off = actor.build_offloader(config(disk_dir), rank_dir, scope="tracked")
        off.track(tensors)
        fallocated = count_fallocate(monkeypatch)
        off.sleep()
        assert fallocated == [sum(align_up(t.nbytes) for t in tensors)]
        off.wake()
        off.close()
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


def test_prepare_after_sleeps_writes_only_the_new_tail_and_keeps_clean_slots(disk_dir, monkeypatch):
    """With skip_clean a unit unchanged since the last sleep is not written again: its
    bytes in the file must survive a later prepare(), which writes zeros over the part the
    new units add and nothing else."""
    tensors = actor_tensors()
    expected = [t.clone() for t in tensors]
    with RankDir(disk_dir, job="t") as rank_dir:
        with actor.build_offloader(config(disk_dir), rank_dir, scope="tracked", skip_clean=True) as off:
            off.track(tensors)
            off.prepare()
            off.sleep()
            off.wake()
            grown = torch.randn(MIB // 4)  # state that appears later (an optimizer's first step)
            off.track([grown])
            before = off.disk_bytes("written")
            old_size = os.path.getsize(os.path.join(rank_dir.path, "offload", STATE_FILE))
            prepared = off.prepare()
            assert prepared.written == align_up(grown.nbytes)
            assert off.disk_bytes("written") - before == prepared.written
            slept = off.sleep()
            assert slept.clean == sum(t.nbytes for t in tensors)  # the old units were not written again
            assert slept.copied == grown.nbytes
            assert off.disk_bytes("written") - before == 2 * prepared.written
            off.wake()
            assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
            assert os.path.getsize(os.path.join(rank_dir.path, "offload", STATE_FILE)) == old_size + prepared.written


def test_prepare_while_asleep_is_refused(disk_dir):
    tensors = actor_tensors()
    with RankDir(disk_dir, job="t") as rank_dir, actor.build_offloader(config(disk_dir), rank_dir) as off:
        off.track(tensors)
        with off.asleep():
            with pytest.raises(GreenroomError, match=r"prepare\(\) while asleep: call wake\(\) first"):
                off.prepare()


@pytest.mark.parametrize("target", ["cpu", "none"])
def test_prepare_without_the_disk_target_writes_nothing(target):
    offload = OffloadConfig(offload_train=target != "none", offload_train_target="cpu")
    off = actor.build_offloader(offload).track(actor_tensors())
    prepared = off.prepare()
    assert prepared.written == 0
    off.close()


def test_no_room_is_refused_at_prepare_in_one_line_and_leaves_nothing(tmp_path):
    """A 1 MiB tmpfs (root only) cannot hold a 6 MiB actor: prepare() names the file and
    what it needs, and the offload dir is left empty; the actor is untouched."""
    full = str(tmp_path / "full")
    os.makedirs(full)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", full], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        tensors = actor_tensors()
        expected = [t.clone() for t in tensors]
        with RankDir(full, job="t", allow_tmpfs=True) as rank_dir:
            with actor.build_offloader(config(full, allow_tmpfs=True), rank_dir) as off:
                off.track(tensors)
                with pytest.raises(StorageError, match="not enough space to preallocate") as info:
                    off.prepare()
                assert "\n" not in str(info.value) and STATE_FILE in str(info.value)
                assert os.listdir(os.path.join(rank_dir.path, "offload")) == []
                assert not off.is_asleep
            assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
        assert os.listdir(full) == []
    finally:
        subprocess.run(["umount", full], check=True)


def test_a_failed_fill_removes_the_file_it_made_and_a_sleep_still_works(disk_dir, fail_a_write_of):
    tensors = actor_tensors()
    expected = [t.clone() for t in tensors]
    with RankDir(disk_dir, job="t") as rank_dir, actor.build_offloader(config(disk_dir), rank_dir) as off:
        off.track(tensors)
        path = os.path.join(rank_dir.path, "offload", STATE_FILE)
        fail_a_write_of(path)
        with pytest.raises(StorageError, match="Input/output error") as info:
            off.prepare()
        assert "\n" not in str(info.value)
        assert not os.path.exists(path)
        with off.asleep():
            assert os.path.exists(path)
        assert all(torch.equal(t, e) for t, e in zip(tensors, expected))


def test_prepare_faults_the_staging_buffers_in(disk_dir, monkeypatch):
    """Unpinned staging memory is mapped on its first write; prepare() writes every page of
    the staging once (``StagingBuffers.touch``), so the first sleep's copies into staging do
    not take those faults. Checked as the call and its writes: whether the pages were
    resident before depends on what the process allocated and freed earlier (a full suite
    run found them resident already), so the RSS is not a reliable witness here."""
    from greenroom.io.staging import StagingBuffers

    touched = []
    real = StagingBuffers.touch

    def touch(self):
        self._backing.fill_(7)  # what the touch must overwrite
        real(self)
        touched.append(self)

    monkeypatch.setattr(StagingBuffers, "touch", touch)
    tensors = actor_tensors()
    with RankDir(disk_dir, job="t") as rank_dir:
        with actor.build_offloader(config(disk_dir, offload_train_disk_chunk_mb=64), rank_dir) as off:
            off.track(tensors)
            off.prepare()
            assert len(touched) == 1
            staging = touched[0]
            assert staging.total_bytes >= 56 * MIB and not staging._backing.any()
