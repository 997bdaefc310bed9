"""``save_checkpoint`` between steps by hard links (``save_load`` Note [a save by links]).

Beside the state (one ext4), the save links every live bucket file into the checkpoint:
no byte of the state read or written (the checksum tables only, read), the same bucket
bytes as a copy of the same state on another filesystem (a real tmpfs mount); the next
steps write new inodes and leave the checkpoint's bytes as they were; a load of it
continues bit-identically to ``torch.optim.AdamW``. With the host cache (its buckets
written out before they are linked) and with compressed files (their frame records are
in the table the link shares). Where links would not do, the save copies and says so:
GREENROOM_VERIFY=0 (no tables to record), and too little room for the next step's new
inodes (on a loop-mounted ext4 image: a full disk is refused at the save, the previous
checkpoint kept). The kills are in ``tests/optim/test_instep.py``.
"""

import copy
import os

import pytest
import torch

from greenroom.errors import StorageError
from greenroom.io import fs
from tests.faults.test_faults import small_ext4
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins
from tests.optim.test_instep import _files, _inodes, _optimizer, _reference, other_fs

SHAPES = ODD_SHAPES + [(100,)]


def _tables(opt):
    return sum(b.file_bytes - b.data_bytes for b in opt.store.buckets)


@pytest.mark.parametrize("case", ["plain", "host cache", "zstd"])
def test_a_save_beside_the_state_links_the_files_and_loads_bit_identically(disk_dir, tmp_path, case):
    kwargs = {"host cache": {"host_cache_gb": 2e-5}, "zstd": {"compression": "zstd"}}.get(case, {})
    ours, ref_params = twins(SHAPES)
    opt = _optimizer(ours, os.path.join(disk_dir, "live"), **kwargs)
    ref = _reference(ref_params)
    if case == "host cache":
        assert 0 < len(opt.store.host_cache) < len(opt.store.buckets)
    for step in range(2):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    path = os.path.join(disk_dir, "ckpt")
    written_before, kept = opt.store.bytes_written, opt.store.kept_bytes
    moved = opt.save_checkpoint(path)
    assert moved == {"kind": "link", "bytes_read": _tables(opt), "bytes_written": 0, "verify": True}
    # The stale files were written out (flush), then linked: the cached buckets', and the
    # one the last step kept on the device (optim.store.held Note [the last bucket stays]).
    assert kept > 0 and opt.store.bytes_written - written_before == kept + sum(
        opt.store.buckets[i].file_bytes for i in opt.store.host_cache
    )
    assert _inodes(path) == _inodes(opt.store.directory)
    assert all(os.stat(os.path.join(path, n)).st_nlink == 2 for n in _inodes(path))
    saved = _files(path)
    with other_fs(tmp_path) as elsewhere:  # the same state copied: the same bucket bytes
        assert opt.save_checkpoint(os.path.join(elsewhere, "ckpt"))["kind"] == "copy"
        if case != "zstd":  # a copy of a compressed file keeps the gaps between frames as they were
            assert _files(os.path.join(elsewhere, "ckpt")) == saved
    weights = [p.detach().clone() for p in ours]
    resumed_ref = copy.deepcopy(ref)
    for step in range(2, 4):  # the live run goes on, bit-identical, and writes new inodes
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    assert_state_equal(opt, ref, ours, ref_params)
    opt.close()  # flushes the cache to new inodes too
    assert _files(path) == saved
    assert all(os.stat(os.path.join(path, n)).st_nlink == 1 for n in _inodes(path))

    resumed = [torch.nn.Parameter(w) for w in weights]
    opt2 = _optimizer(resumed, os.path.join(disk_dir, "fresh"), **kwargs)
    opt2.load_checkpoint(path)
    ref2_params = [p for g in resumed_ref.param_groups for p in g["params"]]
    for step in range(2, 5):
        set_grads(resumed, ref2_params, step=step)
        opt2.step()
        resumed_ref.step()
    assert_state_equal(opt2, resumed_ref, resumed, ref2_params)
    opt2.close()
    assert _files(path) == saved  # the resumed run never wrote the checkpoint


def test_saving_twice_without_a_step_shares_the_inodes_and_leaves_one_link_per_checkpoint(disk_dir):
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    set_grads(params, step=0)
    opt.step()
    path = os.path.join(disk_dir, "ckpt")
    assert opt.save_checkpoint(path)["kind"] == "link"
    saved = _files(path)
    assert opt.save_checkpoint(path)["kind"] == "link"  # the replaced checkpoint's names are gone
    assert _files(path) == saved
    assert all(os.stat(os.path.join(path, n)).st_nlink == 2 for n in _inodes(path))
    assert sorted(n for n in os.listdir(disk_dir) if n.startswith("ckpt")) == ["ckpt"]
    set_grads(params, step=1)
    opt.step()
    assert _files(path) == saved
    # The bucket the step kept on the device (optim.store.held Note [the last bucket stays])
    # still has its old inode, and its new file is made: written back, it takes the name.
    kept = os.path.basename(opt.store.path(opt.store.held.kept.index))
    assert [n for n in os.listdir(opt.store.directory) if n.endswith(".new")] == [kept + ".new"]
    opt.store.flush()
    assert not set(_inodes(path).values()) & set(_inodes(opt.store.directory).values())
    assert not [n for n in os.listdir(opt.store.directory) if n.endswith(".new")]
    opt.close()


def test_without_checksums_the_save_copies(disk_dir, monkeypatch):
    """GREENROOM_VERIFY=0 leaves the tables empty: a link could not be recorded by its
    table, so the bytes are copied with their CRC-32 (the manifest says so)."""
    monkeypatch.setenv("GREENROOM_VERIFY", "0")
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    set_grads(params, step=0)
    opt.step()
    moved = opt.save_checkpoint(os.path.join(disk_dir, "ckpt"))
    assert moved == {
        "kind": "copy",
        "bytes_read": opt.store.state_bytes,
        "bytes_written": opt.store.state_bytes,
        "verify": False,
    }
    assert all(os.stat(os.path.join(disk_dir, "ckpt", n)).st_nlink == 1 for n in _inodes(opt.store.directory))
    opt.close()


def test_without_room_for_the_next_steps_new_inodes_the_save_copies_and_a_full_disk_is_refused(tmp_path):
    """A link costs nothing now and the state's size at the next step (its new inodes);
    without that room free the save copies instead (ext4: copy_file_range moves the
    bytes), so running out of space is refused at the save, in one line, with the
    previous checkpoint kept, never at the next step."""
    with small_ext4(tmp_path, size_mb=32) as (root, _):
        params, _ = twins(SHAPES + [(300, 1000)])  # 2.4 MB of state
        opt = _optimizer(params, os.path.join(root, "live"))
        set_grads(params, step=0)
        opt.step()
        path = os.path.join(root, "ckpt")
        assert opt.save_checkpoint(path)["kind"] == "link"
        set_grads(params, step=1)
        opt.step()  # the live files are new inodes again: the checkpoint holds one copy of the state
        saved = _files(path)
        filler = os.path.join(root, "filler")  # leave half the state's size free, to root too (ext4's reserve)
        st = os.statvfs(root)
        with open(filler, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, st.f_bfree * st.f_frsize - opt.store.state_bytes // 2)
        assert fs.free_bytes(root) < opt.store.state_bytes
        with pytest.raises(
            StorageError,
            match=r"copying \S+/bucket-\d+\.bin to \S+ failed: No space left on "
            r"device",
        ) as info:
            opt.save_checkpoint(path)
        assert "\n" not in str(info.value)
        assert _files(path) == saved
        assert sorted(n for n in os.listdir(root) if n.startswith("ckpt")) == ["ckpt"]
        os.unlink(filler)
        assert opt.save_checkpoint(path)["kind"] == "link"
        opt.close()


def _flip(path, offset=4096 * 3 + 1):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x80]))


def test_a_linked_save_is_read_back_before_it_counts(disk_dir):
    """A save by links reads none of the bytes it shares, so it says ``verify``;
    ``verify_linked`` reads them back against their tables and names a flipped byte;
    ``save_checkpoint(verify=True)`` does that read before it publishes, so the
    checkpoint it would replace stays."""
    from greenroom.errors import CheckpointError

    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    for step in range(2):
        set_grads(params, step=step)
        opt.step()
    path = os.path.join(disk_dir, "ckpt")
    assert opt.save_checkpoint(path)["verify"] is True
    assert opt.verify_linked(path) == sum(b.file_bytes for b in opt.store.buckets)
    before = _files(path)
    set_grads(params, step=2)
    opt.step()
    _flip(opt.store.path(0))  # the live file, before the save links it
    with pytest.raises(CheckpointError, match=r"bucket-00000\.bin: checksum mismatch in extent 0"):
        opt.save_checkpoint(path, verify=True)
    assert _files(path) == before, "the previous checkpoint was replaced by one not verified"
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "live"]
    opt.close()


@pytest.mark.parametrize("how", ["deleted", "unreadable"])
def test_a_live_bucket_file_gone_at_the_save_is_one_checkpoint_error_naming_it(disk_dir, how):
    from greenroom.errors import CheckpointError

    if how == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file whatever its mode")
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    set_grads(params, step=0)
    opt.step()
    live = opt.store.path(0)
    if how == "deleted":
        os.unlink(live)
    else:
        os.chmod(live, 0)
    with pytest.raises(
        CheckpointError,
        match=rf"^{live}: cannot save this live bucket file \(.*\): it was deleted or "
        r"made unreadable since the step wrote it; nothing was published",
    ):
        opt.save_checkpoint(os.path.join(disk_dir, "ckpt"))
    assert sorted(os.listdir(disk_dir)) == ["live"]
    opt.close()
