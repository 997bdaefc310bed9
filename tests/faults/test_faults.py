"""Fault injection on real kernels and files: small ext4 filesystems on loop devices
(losetup, mkfs.ext4, mount) for ENOSPC at setup and during a write (a thin device: a
sparse image on a size-limited tmpfs), the disk failing with EIO in the middle of a
streamed step, a sleep and a wake (the ext4 shutdown ioctl, and a device-mapper target
switched to ``error`` where the kernel has device-mapper), bits flipped on the block
device under a bucket file and under the actor's offload file, and two trainers with
the same job, role and rank.

Every faulty run happens in a subprocess (tests/faults/fault_worker.py) under a watchdog: a
hang fails the test. Mounts, loop devices and dm targets are removed in finalizers, also
when a test fails. Without root, or without the tools, or where the kernel refuses, the
tests skip and say why. ``make test`` installs e2fsprogs and dmsetup (scripts/setup.d).
"""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from tests.cli_support import REPO, greenroom, one_line_error
from tests.dirs.test_rankdir import start_holder

WORKER = os.path.join(REPO, "tests", "faults", "fault_worker.py")
WATCHDOG_S = 120
EIO_LINE = (
    r"error: \S+/(bucket-\d{5}\.bin|actor\.state): (read|write|sync) of \d+ bytes at offset \d+ of "
    r"(bucket \d of the optimizer state|the actor's offload file) failed: Input/output error \(EIO\); "
    r"the device reported an I/O error: .*"
)


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WATCHDOG_S)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: rc {proc.returncode}: {proc.stderr.strip()}")
    return proc


def _require_root_and(*tools: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (loop devices, mount)")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found: `make test` installs it when run as root on Debian")


@contextlib.contextmanager
def _finally_all(*steps):
    """Run every cleanup step even when an earlier one fails."""
    try:
        yield
    finally:
        for step in steps:
            with contextlib.suppress(Exception):
                step()


@contextlib.contextmanager
def tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    proc = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    with _finally_all(lambda: _umount(path)):
        yield path


def _umount(path: str) -> None:
    if _run("umount", path, check=False).returncode != 0:
        _run("umount", "-l", path, check=False)


@contextlib.contextmanager
def loop_device(image: str, size_mb: int):
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)  # sparse: blocks are allocated as the filesystem writes them
    proc = _run("losetup", "--find", "--show", image, check=False)
    if proc.returncode != 0:
        pytest.skip(f"the kernel refused a loop device: {proc.stderr.strip()}")
    dev = proc.stdout.strip()
    with _finally_all(lambda: _run("losetup", "-d", dev, check=False)):
        yield dev


@contextlib.contextmanager
def ext4_on(dev: str, mount_point: str):
    _run("mkfs.ext4", "-q", "-F", "-b", "4096", "-E", "nodiscard", dev)
    os.makedirs(mount_point, exist_ok=True)
    _run("mount", dev, mount_point)
    with _finally_all(lambda: _umount(mount_point)):
        state = os.path.join(mount_point, "state")
        os.mkdir(state)
        yield state


@contextlib.contextmanager
def small_ext4(tmp_path, size_mb: int = 64):
    _require_root_and("losetup", "mkfs.ext4", "mount")
    with loop_device(str(tmp_path / "disk.img"), size_mb) as dev, ext4_on(dev, str(tmp_path / "mnt")) as state:
        yield state, dev


@contextlib.contextmanager
def dm_linear(tmp_path):
    """ext4 on a device-mapper linear target over a loop device; yields (dir, dm name)."""
    _require_root_and("losetup", "mkfs.ext4", "mount", "dmsetup", "blockdev")
    name = f"greenroom-test-{uuid.uuid4().hex[:8]}"
    with loop_device(str(tmp_path / "disk.img"), 64) as dev:
        sectors = _run("blockdev", "--getsz", dev).stdout.strip()
        proc = _run("dmsetup", "create", "--noudevsync", name, "--table", f"0 {sectors} linear {dev} 0", check=False)
        if proc.returncode != 0:
            pytest.skip(f"the kernel has no usable device-mapper: {proc.stderr.strip().splitlines()[0]}")
        with (
            _finally_all(lambda: _run("dmsetup", "remove", "--noudevsync", "--force", name, check=False)),
            ext4_on(f"/dev/mapper/{name}", str(tmp_path / "mnt")) as state,
        ):
            yield state, name


def run_worker(*args: str, prefix=()) -> subprocess.CompletedProcess:
    """The worker in its own process group (under ``prefix``, strace say), killed (and
    the test failed) if it hangs."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "runtime"), REPO]))
    proc = subprocess.Popen(
        [*prefix, sys.executable, WORKER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=WATCHDOG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"fault_worker {' '.join(args)} hung for {WATCHDOG_S} s: an I/O error did not reach the caller")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_one_line(proc: subprocess.CompletedProcess, pattern: str) -> str:
    assert proc.returncode == 3, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), proc.stderr
    return lines[0]


# -- ENOSPC ------------------------------------------------------------------------------
def test_enospc_while_preallocating_buckets_removes_every_file_it_created(tmp_path):
    from greenroom.errors import StorageError
    from greenroom.optim import StreamingAdam

    with small_ext4(tmp_path, 32) as (state, _):
        # 10 MB each: the masters' low halves (Note [remainder]) and two fp32 moments
        params = [torch.nn.Parameter(torch.zeros(1_000_000, dtype=torch.bfloat16)) for _ in range(4)]
        with pytest.raises(
            StorageError,
            match=r"/bucket-0000[123]\.bin: not enough space to preallocate 9\.\d MiB "
            r"\(.* free on .*/mnt\); free space or point --offload-train-disk-dir",
        ):
            StreamingAdam(params, state_dir=state, bucket_numel=1_000_000, chunk_mb=1, resident_numel=0)
        assert os.listdir(state) == []


def test_enospc_during_a_write_on_a_thin_device_names_the_file_and_the_write(tmp_path):
    _require_root_and("losetup", "mkfs.ext4", "mount")
    # A 64 MiB filesystem on a sparse image that may only grow by ~8 MiB: preallocation
    # succeeds (the filesystem has room), the device runs out under the sleep's writes.
    with (
        tmpfs(str(tmp_path / "thin"), "12m") as thin,
        loop_device(os.path.join(thin, "disk.img"), 64) as dev,
        ext4_on(dev, str(tmp_path / "mnt")) as state,
    ):
        proc = run_worker("sleep", state, "none")
        assert_one_line(
            proc,
            r"error: \S+/actor\.state: (write|sync) of \d+ bytes at offset \d+ of the actor's "
            r"offload file failed: No space left on device \(ENOSPC\); the disk is full: .*",
        )


# -- EIO mid-phase ---------------------------------------------------------------------------
@pytest.mark.parametrize("scenario,nth", [("step", 3), ("sleep", 3), ("wake", 2)])
def test_eio_mid_phase_fails_fast_naming_file_and_operation(tmp_path, scenario, nth):
    with small_ext4(tmp_path) as (state, _):
        assert_one_line(run_worker(scenario, state, "shutdown", str(nth)), EIO_LINE)


@pytest.mark.parametrize("scenario,nth", [("step", 3), ("sleep", 3), ("wake", 2)])
def test_dm_error_target_mid_phase_fails_fast(tmp_path, scenario, nth):
    with dm_linear(tmp_path) as (state, name):
        assert_one_line(run_worker(scenario, state, f"dm:{name}", str(nth)), EIO_LINE)


# -- bits flipped under the filesystem ---------------------------------------------------------
def _physical_offset(path: str, offset: int) -> int:
    """Byte offset on the block device of byte ``offset`` of ``path`` (filefrag's map)."""
    out = _run("filefrag", "-v", "-b4096", path).stdout
    block = offset // 4096
    for m in re.finditer(r"^\s*\d+:\s+(\d+)\.\.\s*(\d+):\s+(\d+)\.\.", out, re.M):
        first, last, phys = map(int, m.groups())
        if first <= block <= last:
            return (phys + block - first) * 4096 + offset % 4096
    raise AssertionError(f"{path}: block {block} not mapped:\n{out}")


def _flip_on_device(dev: str, path: str, offset: int) -> None:
    where = _physical_offset(path, offset)
    fd = os.open(dev, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, where)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), where)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")  # whatever the file's pages were, the next read comes from the device


def test_a_bit_flipped_on_the_device_under_a_bucket_file_stops_the_step(tmp_path):
    from greenroom.errors import IntegrityError
    from greenroom.optim import StreamingAdam

    _require_root_and("filefrag")
    with small_ext4(tmp_path) as (state, dev):
        params = [torch.nn.Parameter(torch.randn(400_000, dtype=torch.bfloat16)) for _ in range(3)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = StreamingAdam(params, state_dir=state, bucket_numel=400_000, chunk_mb=1, resident_numel=0)
        try:
            opt.step()
            _flip_on_device(dev, opt.store.path(1), 3 * (1 << 20) + 5)
            with pytest.raises(
                IntegrityError,
                match=r"bucket-00001\.bin: checksum mismatch at offset 3145728 \(bytes "
                r"\[3145728, .*\) of bucket 1 of the optimizer state\)",
            ):
                opt.step()
        finally:
            opt.close()


def test_a_bit_flipped_on_the_device_under_the_offload_file_fails_the_wake(tmp_path):
    from greenroom.actor.offloader import PortableOffloader
    from greenroom.errors import IntegrityError

    _require_root_and("filefrag")
    with small_ext4(tmp_path) as (state, dev):
        model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(2)))
        with PortableOffloader(target="disk", offload_dir=state, chunk_bytes=1 << 20).track(model) as offloader:
            offloader.sleep()
            _flip_on_device(dev, os.path.join(state, "actor.state"), 5 * (1 << 20) + 123)
            with pytest.raises(
                IntegrityError,
                match=r"actor\.state: checksum mismatch at offset 5242880 .* of the "
                r"actor's offload file\)",
            ):
                offloader.wake()


# -- two trainers, one rank dir ---------------------------------------------------------------
def test_a_second_trainer_with_the_same_job_role_and_rank_is_refused_in_one_line(disk_dir):
    holder, path = start_holder(disk_dir, job="same-job")
    try:
        proc = greenroom(
            "train",
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            disk_dir,
            "--iterations",
            "1",
            "--no-progress",
            env={"GREENROOM_JOB_ID": "same-job"},
        )
        line = one_line_error(proc)
        assert re.search(r"is held by a live process \(pid \d+ on .*\)", line), line
        assert os.path.exists(os.path.join(path, "offload", "state.bin")), "the live owner's files were touched"
    finally:
        holder.terminate()
        holder.wait()
