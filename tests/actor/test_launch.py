"""The environment an actor starts with on torch_memory_saver, and the refusal of an
installed torch_memory_saver that cannot back memory up to disk.

These read the real installed package's files (nothing is imported from it: there is
no libcuda here). The refusal uses a fake older install: a site dir whose hook library
lacks TMS_INIT_ENABLE_DISK_BACKUP, as 0.0.9.post1's does.
"""

import os
import subprocess
import sys

import pytest

from greenroom import OffloadConfig, actor
from greenroom.actor import launch
from greenroom.errors import GreenroomError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def disk_config(disk_dir, **kw):
    return OffloadConfig(
        offload_train=True,
        offload_train_target="disk",
        offload_train_disk_dir=disk_dir,
        offload_train_disk_chunk_mb=64,
        **kw,
    )


@pytest.mark.parametrize("major", [12, 13])
def test_disk_target_with_tms_mover_preloads_the_matching_hook_and_sets_disk_backup(disk_dir, major):
    env = actor.launch_env(disk_config(disk_dir), 3, role="critic", job="j1", mover="tms", cuda_major=major)
    hook = env["LD_PRELOAD"].split(":")[0]
    assert os.path.basename(hook) == f"torch_memory_saver_hook_mode_preload_cu{major}.abi3.so"
    assert os.path.isfile(hook)
    assert env["TMS_INIT_ENABLE"] == "1"
    assert env["TMS_INIT_ENABLE_CPU_BACKUP"] == "0"
    assert env["TMS_INIT_ENABLE_DISK_BACKUP"] == "1"
    assert env["TMS_DISK_BACKUP_DIR"] == os.path.join(disk_dir, "j1", "critic", "rank00003", "offload")
    assert env["TMS_DISK_BACKUP_CHUNK_MB"] == "64"
    assert env["GREENROOM_JOB_ID"] == "j1"


def test_cpu_target_with_tms_mover_uses_its_pinned_backup():
    env = actor.launch_env(OffloadConfig(offload_train=True), 0, mover="tms", cuda_major=13)
    assert env["TMS_INIT_ENABLE"] == "1"
    assert env["TMS_INIT_ENABLE_CPU_BACKUP"] == "1"
    assert env["TMS_INIT_ENABLE_DISK_BACKUP"] == "0"
    assert "TMS_DISK_BACKUP_DIR" not in env


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_greenroom_mover_has_tms_only_release_memory(disk_dir, target):
    config = disk_config(disk_dir) if target == "disk" else OffloadConfig(offload_train=True)
    env = actor.launch_env(config, 0, job="j", cuda_major=13)
    assert env["TMS_INIT_ENABLE"] == "1"
    assert env["TMS_INIT_ENABLE_CPU_BACKUP"] == "0"
    assert env["TMS_INIT_ENABLE_DISK_BACKUP"] == "0"
    assert env[launch.MOVER_VAR] == "greenroom"


def test_other_preloads_are_kept_and_an_old_hook_is_replaced(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/libother.so:/old/torch_memory_saver_hook_mode_preload_cu12.abi3.so")
    env = actor.launch_env(OffloadConfig(offload_train=True), 0, cuda_major=13)
    parts = env["LD_PRELOAD"].split(":")
    assert parts[0].endswith("_cu13.abi3.so") and parts[1:] == ["/opt/libother.so"]


def test_nothing_to_preload_without_offload_or_without_cuda(disk_dir):
    assert (
        actor.launch_env(
            OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_disk_dir=disk_dir), 0, cuda_major=13
        )
        == {}
    )
    # No GPU here (a CPU build, or PyPI's CUDA build without a device): the portable
    # backend needs no hook.
    assert actor.launch_env(disk_config(disk_dir), 0) == {}


def fake_site(tmp_path, version, marker: bool):
    site = tmp_path / "site"
    (site / "torch_memory_saver").mkdir(parents=True)
    (site / "torch_memory_saver" / "__init__.py").write_text("")
    (site / f"torch_memory_saver-{version}.dist-info").mkdir()
    symbols = b"\0TMS_INIT_ENABLE\0TMS_INIT_ENABLE_CPU_BACKUP\0" + (b"TMS_INIT_ENABLE_DISK_BACKUP\0" if marker else b"")
    for major in (12, 13):
        (site / f"torch_memory_saver_hook_mode_preload_cu{major}.abi3.so").write_bytes(b"\x7fELF" + symbols)
    return str(site)


def test_a_torch_memory_saver_without_disk_backup_is_refused(disk_dir, tmp_path):
    site = fake_site(tmp_path, "0.0.9.post1", marker=False)
    with pytest.raises(GreenroomError) as err:
        actor.launch_env(disk_config(disk_dir), 0, mover="tms", cuda_major=13, site=site)
    message = str(err.value)
    assert "torch_memory_saver 0.0.9.post1" in message and "does not support disk backup" in message
    assert "TMS_INIT_ENABLE_DISK_BACKUP" in message and "torch-memory-saver==0.0.10" in message
    # The cpu target never asks for disk backup, so the same install is fine for it.
    assert actor.launch_env(OffloadConfig(offload_train=True), 0, mover="tms", cuda_major=13, site=site)


def test_the_installed_torch_memory_saver_passes_the_disk_check():
    for major in (12, 13):
        launch.check_disk_support(launch.hook_library(major))
    assert launch.installed_version(launch.site_dir()) == "0.0.10"


def test_a_missing_hook_for_the_cuda_major_is_a_clear_error(tmp_path):
    site = fake_site(tmp_path, "0.0.10", marker=True)
    with pytest.raises(GreenroomError, match="has no torch_memory_saver_hook_mode_preload_cu11.abi3.so"):
        launch.hook_library(11, site)


def test_cpu_paths_never_import_torch_memory_saver(disk_dir):
    code = f"""
import sys, torch
from greenroom import OffloadConfig, actor
from greenroom.dirs.rankdir import RankDir
config = OffloadConfig(offload_train=True, offload_train_target="disk", offload_train_disk_dir={disk_dir!r})
actor.launch_env(config, 0)
with RankDir({disk_dir!r}, job="x") as rd, actor.build_offloader(config, rd) as off:
    off.track([torch.ones(10)])
    off.sleep(); off.wake()
assert "torch_memory_saver" not in sys.modules, "imported on a CPU path"
"""
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime")}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


def test_tms_backend_without_the_preloaded_hook_says_how_to_start(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with pytest.raises(GreenroomError, match="launch_env"):
        actor.build_offloader(OffloadConfig(offload_train=True), backend="tms", device="cpu")


def test_relaunch_re_executes_the_same_command_under_the_new_environment():
    code = """
import os, sys
from greenroom.actor import relaunch_with
print(os.getpid(), os.environ.get("GREENROOM_TEST_VAR"), sys.argv[1:], flush=True)
relaunch_with({"GREENROOM_TEST_VAR": "set"})
"""
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime")}
    env.pop("GREENROOM_TEST_VAR", None)
    out = subprocess.run(
        [sys.executable, "-c", code, "arg1"], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    first, second = out[0].split(" ", 2), out[1].split(" ", 2)
    assert first[0] == second[0]  # same pid: torchrun and Slurm keep tracking the rank
    assert first[1:] == ["None", "['arg1']"] and second[1:] == ["set", "['arg1']"]
