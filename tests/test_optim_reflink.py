"""Checkpoints between steps as extent clones (FICLONE) on a loop-mounted XFS with reflink.

The clone moves no data: the filesystem's free space does not drop by the state's size
at the save; the next step's writes to the live files leave the checkpoint's bytes as
they were (copy on write); loading it (cloned back) continues bit-identically to
``torch.optim.AdamW``. Where the filesystem cannot clone (the ext4 test dir), the save
copies, as before.
"""

import contextlib
import os

import pytest
import torch

from greenroom import fs
from greenroom.optim import StreamingAdam
from tests.test_faults import _finally_all, _require_root_and, _run, _umount, loop_device
from tests.test_optim_support import ODD_SHAPES, assert_state_equal, set_grads, twins

SHAPES = ODD_SHAPES + [(100,), (300, 1000)]  # the last: a 2.4 MB bucket, clearly visible in the free space


@contextlib.contextmanager
def small_xfs(tmp_path, size_mb: int = 320):
    """An XFS with reflink on a sparse loop device (mkfs.xfs wants 300 MB at least)."""
    _require_root_and("losetup", "mkfs.xfs", "mount")
    with loop_device(str(tmp_path / "xfs.img"), size_mb) as dev:
        proc = _run("mkfs.xfs", "-q", "-f", "-m", "reflink=1", dev, check=False)
        if proc.returncode != 0:
            pytest.skip(f"mkfs.xfs with reflink failed here: {proc.stderr.strip().splitlines()[-1]}")
        mount_point = str(tmp_path / "xfs")
        os.makedirs(mount_point)
        proc = _run("mount", "-t", "xfs", dev, mount_point, check=False)
        if proc.returncode != 0:
            pytest.skip(f"this kernel cannot mount XFS: {proc.stderr.strip()}")
        with _finally_all(lambda: _umount(mount_point)):
            yield mount_point


def _optimizer(params, directory):
    return StreamingAdam(params, lr=1e-2, weight_decay=0.01, state_dir=directory, bucket_numel=4000,
                         resident_numel=100)


def _files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.startswith("bucket-")}


def test_a_checkpoint_on_xfs_clones_the_bucket_files_and_loads_bit_identically(tmp_path):
    with small_xfs(tmp_path) as root:
        ours, ref_params = twins(SHAPES)
        opt = _optimizer(ours, os.path.join(root, "live"))
        ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, foreach=True)
        for step in range(3):
            set_grads(ours, ref_params, step=step)
            opt.step()
            ref.step()
        path = os.path.join(root, "ckpt")
        free = fs.free_bytes(root)
        moved = opt.save_checkpoint(path)
        assert moved == {"kind": "clone", "bytes_read": moved["bytes_read"], "bytes_written": 0}
        assert moved["bytes_read"] < opt.store.state_bytes // 100  # the checksum tables only
        assert free - fs.free_bytes(root) < opt.store.state_bytes // 2, "the clone took the state's space"
        saved = _files(path)
        weights = [p.detach().clone() for p in ours]
        for step in range(3, 5):  # copy on write: the live files move on, the checkpoint's stay
            set_grads(ours, step=step)
            opt.step()
        assert _files(path) == saved
        with torch.no_grad():
            for p, w in zip(ours, weights):
                p.copy_(w)
        opt.load_checkpoint(path)  # verified against the tables, then cloned back
        for step in range(3, 6):
            set_grads(ours, ref_params, step=step)
            opt.step()
            ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
        opt.close()


def test_where_the_filesystem_cannot_clone_the_save_copies(disk_dir):
    if fs.mount_of(disk_dir).fstype in ("xfs", "btrfs"):
        pytest.skip(f"{disk_dir} is on {fs.mount_of(disk_dir).fstype}, which may clone")
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    moved = opt.save_checkpoint(os.path.join(disk_dir, "ckpt"))
    assert moved == {"kind": "copy", "bytes_read": opt.store.state_bytes, "bytes_written": opt.store.state_bytes}
    opt.close()
