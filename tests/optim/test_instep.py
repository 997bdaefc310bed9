"""Checkpoints written by the step's own pass (``checkpoint_next_step``), and under SIGKILL.

- The in-step checkpoint of step N holds the same bytes as ``save_checkpoint`` right
  after step N (the bucket files byte for byte), reads no byte of the state, and a load
  of it continues bit-identically to ``torch.optim.AdamW``: with every bucket streamed,
  with a bucket the step skipped (linked or copied), with the host cache, and with a
  compressed store; by links (the checkpoint beside the state, one ext4) and by a second
  write (the checkpoint on another filesystem: a real tmpfs mount, so link() gives EXDEV).
- By links: the checkpoint's files are the step's own new inodes (no byte written
  twice); the next step writes new inodes again and leaves the checkpoint's bytes as
  they were, as it leaves a user's ``cp -l`` backup; a load links the files back and the
  resumed run never writes them; a write into a shared inode is refused in one line.
- Damage is refused in one line naming the file, before the live state changes.
- A kill at any point of the in-step save, or of a save between steps (by links, or
  copied to another filesystem), leaves the previous checkpoint loadable (or, once
  swapped in, the new one), in a real process killed with SIGKILL; so does a kill in
  the step after either kind of linked checkpoint.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import textwrap

import pytest
import torch

from greenroom.errors import CheckpointError, ConfigError, IntegrityError, StorageError
from greenroom.optim import StreamingAdam
from tests.cli_support import python_forked
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins

SHAPES = ODD_SHAPES + [(100,)]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _optimizer(params, directory, **kwargs):
    groups = [{"params": params[:4]}, {"params": params[4:], "lr": 2e-3, "weight_decay": 0.05}]
    kwargs = {"lr": 1e-2, "weight_decay": 0.01, "bucket_numel": 2000, "resident_numel": 100, **kwargs}
    return StreamingAdam(groups, state_dir=directory, **kwargs)


def _reference(params):
    groups = [{"params": params[:4]}, {"params": params[4:], "lr": 2e-3, "weight_decay": 0.05}]
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01, foreach=True)


def _files(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.startswith("bucket-")}


def _inodes(path):
    return {n: os.stat(os.path.join(path, n)).st_ino for n in sorted(os.listdir(path)) if n.startswith("bucket-")}


@contextlib.contextmanager
def other_fs(tmp_path):
    """A dir on a tmpfs of its own (root only): another filesystem than the state's, so
    link() between them fails with EXDEV, as it does for a checkpoint on another disk."""
    mount_point = str(tmp_path / "other-fs")
    os.makedirs(mount_point)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mount_point], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs (another filesystem for the checkpoint) needs root")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", mount_point], check=True)


@pytest.mark.parametrize("mode", ["link", "write"])
@pytest.mark.parametrize("case", ["all streamed", "a bucket skipped", "host cache", "zstd"])
def test_in_step_checkpoint_matches_a_save_after_the_step_and_loads_bit_identically(disk_dir, tmp_path, case, mode):
    ours, ref_params = twins(SHAPES)
    kwargs = {"host cache": {"host_cache_gb": 2e-5}, "zstd": {"compression": "zstd"}}.get(case, {})
    opt = _optimizer(ours, os.path.join(disk_dir, "live"), **kwargs)
    ref = _reference(ref_params)
    if case == "host cache":
        assert 0 < len(opt.store.host_cache) < len(opt.store.buckets)
    with other_fs(tmp_path) if mode == "write" else contextlib.nullcontext(disk_dir) as where:
        try:
            _checkpoint_and_resume(opt, ref, ours, ref_params, where, case, mode)
        finally:
            opt.close()


def _checkpoint_and_resume(opt, ref, ours, ref_params, where, case, mode):
    skip = {0, 1, 2, 3} if case == "a bucket skipped" else ()  # group 0's params: its buckets get no grads
    for step in range(3):
        set_grads(ours, ref_params, step=step, skip=skip if step == 2 else ())
        if step == 2:
            opt.checkpoint_next_step(os.path.join(where, "in-step"))
        opt.step()
        ref.step()
    written = opt.last_checkpoint
    assert written.mode == mode
    skipped = [b for b in opt.store.buckets if b.index not in written.mirrored and b.index not in opt.store.host_cache]
    if case == "a bucket skipped":
        assert skipped
        assert written.extra_bytes_read == sum(
            b.file_bytes - b.data_bytes if mode == "link" else b.file_bytes for b in skipped
        )  # a link reads the table only
    else:
        assert written.extra_bytes_read == 0
    if mode == "link" and case != "host cache":  # a cached bucket is written from host memory
        assert written.extra_bytes_written == 0
        assert _inodes(os.path.join(where, "in-step")) == _inodes(opt.store.directory)
    else:
        assert written.extra_bytes_written > 0
    opt.save_checkpoint(os.path.join(where, "after"))
    if case != "zstd":  # compressed files leave the gaps between frames as they were
        assert _files(os.path.join(where, "in-step")) == _files(os.path.join(where, "after"))
    saved = _files(os.path.join(where, "in-step"))
    weights = [p.detach().clone() for p in ours]  # the model's part of the checkpoint
    for step in range(3, 5):  # moves on, then comes back
        set_grads(ours, step=step)
        opt.step()
    with torch.no_grad():
        for p, w in zip(ours, weights):
            p.copy_(w)
    assert _files(os.path.join(where, "in-step")) == saved  # the steps after it wrote new inodes
    opt.load_checkpoint(os.path.join(where, "in-step"))
    if mode == "link":
        assert _inodes(os.path.join(where, "in-step")) == _inodes(opt.store.directory)
    for step in range(3, 6):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    assert_state_equal(opt, ref, ours, ref_params)
    assert _files(os.path.join(where, "in-step")) == saved  # the resumed run never wrote the checkpoint


def _damaged(disk_dir, change):
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    set_grads(params, step=0)
    opt.checkpoint_next_step(os.path.join(disk_dir, "ckpt"))
    opt.step()
    change(os.path.join(disk_dir, "ckpt", "bucket-00001.bin"), opt.store.buckets[1])
    before = _files(os.path.join(disk_dir, "live"))
    with pytest.raises(CheckpointError) as info:
        opt.load_checkpoint(os.path.join(disk_dir, "ckpt"))
    assert _files(os.path.join(disk_dir, "live")) == before
    opt.close()
    return str(info.value)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def test_a_flipped_data_byte_is_refused_naming_the_file_and_extent(disk_dir):
    said = _damaged(disk_dir, lambda path, bucket: _flip(path, 100))
    assert "bucket-00001.bin: checksum mismatch in extent 0" in said and "\n" not in said


def test_a_flipped_table_byte_is_refused_naming_the_file(disk_dir):
    said = _damaged(disk_dir, lambda path, bucket: _flip(path, bucket.data_bytes + 3))
    assert "bucket-00001.bin: checksum table CRC-32" in said and "does not match the manifest's" in said


def test_an_in_step_checkpoint_needs_verification_on(disk_dir, monkeypatch):
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    monkeypatch.setenv("GREENROOM_VERIFY", "0")
    with pytest.raises(ConfigError, match="GREENROOM_VERIFY=0"):
        opt.checkpoint_next_step(os.path.join(disk_dir, "ckpt"))
    assert not os.path.exists(os.path.join(disk_dir, "ckpt.new"))
    opt.close()


def test_no_room_for_the_checkpoint_is_refused_before_the_step_changes_anything(disk_dir, tmp_path):
    """A 256 KiB tmpfs (root only) cannot hold the preallocated checkpoint files: refused
    in one line at the request, nothing staged left, the live state untouched."""
    full = str(tmp_path / "full")
    os.makedirs(full)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", full], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        params, _ = twins(SHAPES + [(300, 1000)])  # 2.4 MB of state
        opt = _optimizer(params, os.path.join(disk_dir, "live"))
        before = _files(os.path.join(disk_dir, "live"))
        with pytest.raises(StorageError, match="not enough space to preallocate") as info:
            opt.checkpoint_next_step(os.path.join(full, "ckpt"))
        assert "\n" not in str(info.value)
        assert os.listdir(full) == []
        assert _files(os.path.join(disk_dir, "live")) == before
        set_grads(params, step=0)
        opt.step()  # the refused request left nothing pending: a plain step
        assert opt.last_checkpoint is None
        opt.close()
    finally:
        subprocess.run(["umount", full], check=True)


# -- SIGKILL at every point of the in-step save -----------------------------------------
WORKER = textwrap.dedent("""
    import os, shutil, sys
    sys.path.insert(0, {repo!r})
    from tests.optim.test_instep import SHAPES, _optimizer
    from tests.optim.support import set_grads, twins
    base, point, previous, last, where = sys.argv[1:6]
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(base, "live"))
    for step in range(2):
        set_grads(params, step=step)
        if step == 1 and previous == "linked":  # the live files share the previous checkpoint's inodes
            opt.checkpoint_next_step(os.path.join(where, "ckpt"))
        if step == 1 and previous == "saved":  # a save between steps, then a step: nothing shared
            opt.save_checkpoint(os.path.join(where, "ckpt"))
        opt.step()
    if previous == "saved-now":  # a save by links right before the last step: its inodes are the live files
        opt.save_checkpoint(os.path.join(where, "ckpt"))
    shutil.copytree(os.path.join(where, "ckpt"), os.path.join(base, "before"))
    if point != "none":
        os.environ["GREENROOM_TEST_KILL_AT"] = point
    set_grads(params, step=2)
    if last == "checkpoint":
        opt.checkpoint_next_step(os.path.join(where, "ckpt"))
    opt.step()
    if last == "save":  # the same state saved between steps instead
        opt.save_checkpoint(os.path.join(where, "ckpt"))
    opt.close()
""")


def _run_worker(base, point, previous="saved", last="checkpoint", where=None):
    script = os.path.join(base, "worker.py")
    with open(script, "w") as f:
        f.write(WORKER.format(repo=REPO))
    # A process of its own, forked from a Python that has imported torch already.
    return python_forked(script, base, point, previous, last, where or base, timeout=120, cwd=REPO)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The bucket files of the checkpoint an uninterrupted in-step save publishes."""
    base = str(tmp_path_factory.mktemp("instep-reference"))
    done = _run_worker(base, "none")
    assert done.returncode == 0, done.stderr
    return _files(os.path.join(base, "ckpt"))


def _state(opt):
    sd = opt.state_dict()
    return {(key, name): t.clone() for key, entry in sd["state"].items() for name, t in entry.items()}


def _assert_live_buckets_whole(base, opt, *, torn_refused=False):
    """Every live bucket name the killed run left names a whole bucket: the step's or the
    one before it, each verified against its own checksum table (never a torn mix).
    ``torn_refused``: a bucket the kill caught mid-write in place (its inode had no other
    name) may be torn; then reading it is refused in one line, never used."""
    from greenroom.optim.checkpoint.checks import verify_against_table

    live = [
        os.path.join(d, n)
        for d, _, names in os.walk(os.path.join(base, "live"))
        for n in names
        if n.startswith("bucket-") and n.endswith(".bin")
    ]
    assert len(live) == len(opt.store.buckets)
    for path in live:
        index = int(os.path.basename(path)[len("bucket-") : -len(".bin")])
        with opt.store.open_existing(index, path) as f:
            try:
                verify_against_table(f)
            except IntegrityError as e:
                assert torn_refused and "checksum mismatch" in str(e) and "\n" not in str(e)


def test_a_publish_that_fails_after_a_whole_step_raises_without_poisoning(disk_dir, monkeypatch):
    """The checkpoint's last part (resident.pt, the manifest, the publish) fails with
    ENOSPC after every bucket stepped: raised inside the step's poison, it would say
    "partly updated" of a whole step and refuse every save. The error is raised outside
    it, nothing of the checkpoint is left, and the run goes on like AdamW."""
    from greenroom.optim.checkpoint import instep

    ours, theirs = twins(SHAPES)
    opt = _optimizer(ours, os.path.join(disk_dir, "live"))
    ref = torch.optim.AdamW(
        [{"params": theirs[:4]}, {"params": theirs[4:], "lr": 2e-3, "weight_decay": 0.05}],
        lr=1e-2,
        weight_decay=0.01,
        foreach=True,
    )
    set_grads(ours, theirs, step=0)
    opt.step()
    ref.step()
    ckpt = os.path.join(disk_dir, "ckpt")
    opt.checkpoint_next_step(ckpt)

    def no_room(*args, **kwargs):
        raise StorageError(f"{ckpt}: writing resident.pt failed: No space left on device (ENOSPC)")

    monkeypatch.setattr(instep, "finish_checkpoint", no_room)
    set_grads(ours, theirs, step=1)
    with pytest.raises(StorageError, match="No space left on device"):
        opt.step()
    ref.step()
    assert not os.path.exists(ckpt) and not os.path.exists(ckpt + ".new")
    monkeypatch.undo()
    opt.save_checkpoint(os.path.join(disk_dir, "other"))  # not poisoned
    set_grads(ours, theirs, step=2)
    opt.step()
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    opt.close()


def test_add_param_group_between_the_request_and_the_step_is_refused(disk_dir):
    """The request preallocates a file per bucket there is; a group added after it got no
    file, and the step then failed part way (IndexError) or, without grads in the new
    group, published a checkpoint lacking its buckets, found only by a load."""
    params, _ = twins(SHAPES)
    opt = _optimizer(params[:4], os.path.join(disk_dir, "live"))
    opt.checkpoint_next_step(os.path.join(disk_dir, "ckpt"))
    with pytest.raises(ConfigError, match=r"add_param_group\(\) between checkpoint_next_step\(\) and step\(\)"):
        opt.add_param_group({"params": params[4:]})
    assert len(opt.param_groups) == 2  # _optimizer's second group, empty: nothing was added
    set_grads(params[:4], step=0)
    opt.step()
    opt.close()


@pytest.mark.parametrize(
    "point,published,previous,mode",
    [
        ("instep-bucket@2", False, "saved", "link"),  # mid-stream: the second bucket's file handed out
        ("bucket-linked@2", False, "saved", "link"),  # two buckets written in place, linked into the staged one
        ("instep-bucket@3", False, "saved", "link"),  # the last of the 3 buckets
        ("instep-streamed", False, "saved", "link"),  # every bucket written, nothing published
        ("save-staged", False, "saved", "link"),  # complete and recorded, not yet swapped in
        ("save-swapped", True, "saved", "link"),  # swapped in, the replaced one not yet discarded
        ("discard", True, "saved", "link"),
        # The previous checkpoint by links too: the live files were its inodes when the step
        # began, so the step writes each bucket to the new checkpoint's file and relinks the live name.
        ("bucket-replaced@2", False, "linked", "link"),
        ("instep-streamed", False, "linked", "link"),
        ("save-swapped", True, "linked", "link"),
        # The checkpoint on another filesystem (a tmpfs: link() gives EXDEV): the second write.
        ("instep-bucket@2", False, "saved", "write"),
        ("instep-streamed", False, "saved", "write"),
        ("save-swapped", True, "saved", "write"),
    ],
)
def test_killed_during_the_in_step_save_leaves_a_loadable_checkpoint(
    disk_dir, tmp_path, finished, point, published, previous, mode
):
    with other_fs(tmp_path) if mode == "write" else contextlib.nullcontext(disk_dir) as where:
        _killed_and_loaded(disk_dir, where, finished, point, published, previous)


@pytest.mark.parametrize(
    "point,published,previous,mode",
    [
        # By links (save_load Note [a save by links]), the previous checkpoint saved a step before.
        ("save-bucket@1", False, "saved", "link"),  # one bucket file linked into the staged dir
        ("save-bucket@3", False, "saved", "link"),  # all of them, before resident.pt and the manifest
        ("save-staged", False, "saved", "link"),  # complete and recorded, not yet swapped in
        ("save-swapped", True, "saved", "link"),  # swapped in, the replaced one not yet discarded
        ("discard", True, "saved", "link"),
        # The previous checkpoint's inodes still the live files' (saved by links just before
        # the step): the step gave them new inodes, and the new save links those.
        ("save-bucket@2", False, "saved-now", "link"),
        ("save-swapped", True, "saved-now", "link"),
        # The checkpoint on another filesystem (a tmpfs): copied.
        ("save-bucket@2", False, "saved", "write"),
        ("save-swapped", True, "saved", "write"),
    ],
)
def test_killed_during_a_save_between_steps_leaves_a_loadable_checkpoint(
    disk_dir, tmp_path, finished, point, published, previous, mode
):
    with other_fs(tmp_path) if mode == "write" else contextlib.nullcontext(disk_dir) as where:
        _killed_and_loaded(disk_dir, where, finished, point, published, previous, last="save")


def _killed_and_loaded(disk_dir, where, finished, point, published, previous, last="checkpoint"):
    killed = _run_worker(disk_dir, point, previous, last, where=where)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    if last == "save" and point.startswith("save-bucket"):  # what the kill left staged: links, or copies
        staged = _inodes(os.path.join(where, "ckpt.new"))
        [live] = [_inodes(d) for d, _, names in os.walk(os.path.join(disk_dir, "live")) if "bucket-00000.bin" in names]
        assert len(staged) == int(point.partition("@")[2])
        assert all((ino == live[n]) == (where == disk_dir) for n, ino in staged.items())
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "fresh"))
    _assert_live_buckets_whole(disk_dir, opt, torn_refused=previous == "saved")
    opt.load_checkpoint(os.path.join(where, "ckpt"))  # settles what the kill left, verifies, loads
    expected = finished if published else _files(os.path.join(disk_dir, "before"))
    if point == "save-staged":  # a complete save found beside the previous one is finished, not dropped
        expected = finished
    assert _files(os.path.join(where, "ckpt")) == expected
    if expected is not finished:  # the previous checkpoint, loaded bit-identically to its untouched copy
        loaded = _state(opt)
        opt.load_checkpoint(os.path.join(disk_dir, "before"))
        assert loaded.keys() == _state(opt).keys()
        assert all(torch.equal(loaded[k], t) for k, t in _state(opt).items())
    opt.close()
    shutil.rmtree(os.path.join(disk_dir, "before"))
    assert sorted(n for n in os.listdir(where) if n.startswith("ckpt")) == ["ckpt"]


@pytest.mark.parametrize("previous", ["linked", "saved-now"])
@pytest.mark.parametrize("point", ["bucket-replaced@1", "bucket-replaced@2"])
def test_killed_in_the_step_after_a_linked_checkpoint_leaves_it_as_it_was(disk_dir, point, previous):
    """The plain step after a checkpoint by links (written in the step, or saved between
    steps) writes every bucket to a new inode; a kill after some of them were renamed
    over the live names leaves the checkpoint's bytes as they were, loading
    bit-identically, and every live name whole."""
    killed = _run_worker(disk_dir, point, previous, "plain")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "fresh"))
    _assert_live_buckets_whole(disk_dir, opt)
    assert _files(os.path.join(disk_dir, "ckpt")) == _files(os.path.join(disk_dir, "before"))
    opt.load_checkpoint(os.path.join(disk_dir, "ckpt"))
    loaded = _state(opt)
    opt.load_checkpoint(os.path.join(disk_dir, "before"))
    assert all(torch.equal(loaded[k], t) for k, t in _state(opt).items())
    opt.close()


# -- links: the checkpoint's inodes are never written ------------------------------------
def test_the_step_after_a_linked_checkpoint_writes_new_inodes_and_leaves_a_hard_linked_backup_alone(disk_dir):
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    set_grads(params, step=0)
    opt.step()
    backup = os.path.join(disk_dir, "backup")  # a user's `cp -l` of the live dir, no checkpoint involved
    os.makedirs(backup)
    for name in _files(opt.store.directory):
        os.link(os.path.join(opt.store.directory, name), os.path.join(backup, name))
    backed_up = _files(backup)
    set_grads(params, step=1)
    opt.checkpoint_next_step(os.path.join(disk_dir, "ckpt"))
    opt.step()
    ckpt = os.path.join(disk_dir, "ckpt")
    assert _inodes(ckpt) == _inodes(opt.store.directory)
    assert all(os.stat(os.path.join(ckpt, n)).st_nlink == 2 for n in _inodes(ckpt))
    saved = _files(ckpt)
    for step in (2, 3):
        set_grads(params, step=step)
        opt.step()
    assert not set(_inodes(ckpt).values()) & set(_inodes(opt.store.directory).values())
    assert all(os.stat(os.path.join(ckpt, n)).st_nlink == 1 for n in _inodes(ckpt))
    assert _files(ckpt) == saved
    assert _files(backup) == backed_up
    assert not [n for n in os.listdir(opt.store.directory) if n.endswith(".new")]
    opt.close()


def test_a_load_right_after_a_linked_checkpoint_leaves_one_link_per_name_and_resumes(disk_dir):
    """The live names already name the checkpoint's inodes: the load's links change
    nothing (rename(2) between two names of one inode is a no-op) and leave no stray
    ``.new`` name; the next steps still leave the checkpoint as it was."""
    ours, ref_params = twins(SHAPES)
    opt = _optimizer(ours, os.path.join(disk_dir, "live"))
    ref = _reference(ref_params)
    set_grads(ours, ref_params, step=0)
    opt.checkpoint_next_step(os.path.join(disk_dir, "ckpt"))
    opt.step()
    ref.step()
    saved = _files(os.path.join(disk_dir, "ckpt"))
    opt.load_checkpoint(os.path.join(disk_dir, "ckpt"))
    assert sorted(os.listdir(opt.store.directory)) == sorted(_inodes(opt.store.directory))
    assert all(os.stat(os.path.join(disk_dir, "ckpt", n)).st_nlink == 2 for n in saved)
    for step in (1, 2):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    assert_state_equal(opt, ref, ours, ref_params)
    assert _files(os.path.join(disk_dir, "ckpt")) == saved
    opt.close()


def test_a_copying_load_into_shared_live_files_leaves_the_other_names_alone(disk_dir, tmp_path):
    """A checkpoint on another filesystem is copied in, not linked; where a live file has
    another name (a ``cp -l`` backup), the copy goes to a new inode renamed over the live
    name, so the backup keeps its bytes, and the run resumes bit-identically."""
    ours, ref_params = twins(SHAPES)
    opt = _optimizer(ours, os.path.join(disk_dir, "live"))
    ref = _reference(ref_params)
    with other_fs(tmp_path) as where:
        set_grads(ours, ref_params, step=0)
        opt.checkpoint_next_step(os.path.join(where, "ckpt"))
        opt.step()
        ref.step()
        assert opt.last_checkpoint.mode == "write"
        weights = [p.detach().clone() for p in ours]
        set_grads(ours, step=1)
        opt.step()  # moves on; the checkpoint is of step 0
        backup = os.path.join(disk_dir, "backup")
        os.makedirs(backup)
        for name in _files(opt.store.directory):
            os.link(os.path.join(opt.store.directory, name), os.path.join(backup, name))
        backed_up = _files(backup)
        with torch.no_grad():
            for p, w in zip(ours, weights):
                p.copy_(w)
        opt.load_checkpoint(os.path.join(where, "ckpt"))
        assert _files(backup) == backed_up
        assert _files(opt.store.directory) == _files(os.path.join(where, "ckpt"))
        assert not set(_inodes(backup).values()) & set(_inodes(opt.store.directory).values())
        for step in (1, 2):
            set_grads(ours, ref_params, step=step)
            opt.step()
            ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
        assert _files(backup) == backed_up
        opt.close()


def test_a_write_in_place_into_a_shared_bucket_file_is_refused_in_one_line(disk_dir):
    """The last line of the rule (``io.engine`` Note [shared inodes]): the engine's file
    refuses the write itself, whatever the caller forgot."""
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    set_grads(params, step=0)
    opt.step()
    other = os.path.join(disk_dir, "other-name")
    os.link(opt.store.path(0), other)
    before = open(other, "rb").read()
    with pytest.raises(StorageError, match="refusing to write bucket 0 of the optimizer state in place") as info:
        opt.store.files[0].write(memoryview(bytearray(4096)), 0)
    assert "\n" not in str(info.value) and "2 links" in str(info.value)
    assert open(other, "rb").read() == before
    opt.close()
