"""Checkpoints between steps on a loop-mounted XFS with reflink: by hard links, and by
extent clones (FICLONE) where links are refused.

Beside the state a save links (``save_load`` Note [a save by links]). In an XFS project
tree of another project (``xfs_io chproj`` + ``chattr +P``: the way a site gives a
checkpoint dir its own quota) link() gives EXDEV while FICLONE still works: there the
save clones. Either moves no data: the filesystem's free space does not drop by the
state's size at the save; the next step's writes leave the checkpoint's bytes as they
were (new inodes, or copy on write); loading it continues bit-identically to
``torch.optim.AdamW``. Where neither works (another filesystem) the save copies.
"""

import contextlib
import os
import shutil

import pytest
import torch

from greenroom.io import fs
from greenroom.optim import StreamingAdam
from tests.faults.test_faults import _finally_all, _require_root_and, _run, _umount, loop_device
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins
from tests.optim.test_instep import other_fs

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
    return StreamingAdam(params, lr=1e-2, weight_decay=0.01, state_dir=directory, bucket_numel=4000, resident_numel=100)


def _files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.startswith("bucket-")}


def _project_tree(path):
    """``path`` made an XFS project tree of project 42: links from outside it are EXDEV."""
    os.makedirs(path)
    if shutil.which("xfs_io") is None:
        pytest.skip("xfs_io not found: `make test` installs xfsprogs when run as root on Debian")
    _run("xfs_io", "-c", "chproj 42", "-c", "chattr +P", path)
    return path


@pytest.mark.parametrize("kind", ["link", "clone"])
def test_a_checkpoint_on_xfs_links_or_clones_the_bucket_files_and_loads_bit_identically(tmp_path, kind):
    with small_xfs(tmp_path) as root:
        ours, ref_params = twins(SHAPES)
        opt = _optimizer(ours, os.path.join(root, "live"))
        ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, foreach=True)
        for step in range(3):
            set_grads(ours, ref_params, step=step)
            opt.step()
            ref.step()
        parent = _project_tree(os.path.join(root, "project")) if kind == "clone" else root
        path = os.path.join(parent, "ckpt")
        free = fs.free_bytes(root)
        moved = opt.save_checkpoint(path)
        assert moved == {"kind": kind, "bytes_read": moved["bytes_read"], "bytes_written": 0, "verify": True}
        assert moved["bytes_read"] < opt.store.state_bytes // 100  # the checksum tables only
        assert free - fs.free_bytes(root) < opt.store.state_bytes // 2, "the save took the state's space"
        linked = os.stat(os.path.join(path, "bucket-00000.bin")).st_nlink
        assert linked == (2 if kind == "link" else 1)
        saved = _files(path)
        weights = [p.detach().clone() for p in ours]
        for step in range(3, 5):  # new inodes, or copy on write: the live files move on, the checkpoint's stay
            set_grads(ours, step=step)
            opt.step()
        assert _files(path) == saved
        with torch.no_grad():
            for p, w in zip(ours, weights):
                p.copy_(w)
        opt.load_checkpoint(path)  # verified against the tables, then linked or cloned back
        for step in range(3, 6):
            set_grads(ours, ref_params, step=step)
            opt.step()
            ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
        assert _files(path) == saved
        opt.close()


def test_where_neither_links_nor_clones_work_the_save_copies(disk_dir, tmp_path):
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    with other_fs(tmp_path) as elsewhere:  # another filesystem: link() and FICLONE give EXDEV
        moved = opt.save_checkpoint(os.path.join(elsewhere, "ckpt"))
        assert moved == {
            "kind": "copy",
            "bytes_read": opt.store.state_bytes,
            "bytes_written": opt.store.state_bytes,
            "verify": False,
        }
        opt.close()
