"""Bring your own trainer: deploy/examples/hf_trainer.py (HF Trainer, StreamingAdam and the
offloader, its flags from $GREENROOM_ARGS) rendered under the chart in every storage mode,
and the rendered container run.

The run takes the trainer container exactly as `helm template` renders it (command, args,
env) and executes it here the way the kubelet would: `$(VAR)` references expanded from the
container's env, the downward-API values filled in (the pod's index 0, a job and pod UID).
What differs from a pod, and why: MASTER_ADDR is pod 0's DNS name, which resolves only in
the cluster, so it is 127.0.0.1 here; the storage is a temp dir mounted at the values'
mountPath (no volume plugin runs here); `greenroom` and `python` are this interpreter's.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.chart.support import container, manifests, pod_spec
from tests.conftest import REPO

pytestmark = pytest.mark.helm

SCRIPT = os.path.join(REPO, "deploy", "examples", "hf_trainer.py")
MODES = {"hostPath": (), "emptyDir": (), "ephemeral": (), "pvc": ("storage.pvc.claimName=scratch",)}


def rendered_trainer(mode: str, *sets: str) -> dict:
    docs = manifests(
        sets=(
            "command={python,/app/hf_trainer.py}",
            "args={/out}",
            "nodes=2",
            "procsPerNode=2",
            "gpu.count=2",
            "offload.train=true",
            "offload.target=disk",
            "streamOptimizerState.toDisk=true",
            f"storage.mode={mode}",
            *MODES[mode],
            *sets,
        )
    )
    return container(pod_spec(docs), "trainer")


@pytest.mark.parametrize("mode", MODES)
def test_the_hf_trainer_script_renders_in_every_storage_mode_with_the_distributed_env(mode):
    trainer = rendered_trainer(mode)
    assert trainer["args"][-3:] == ["python", "/app/hf_trainer.py", "/out"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("2", "2", "4", "29500")
    assert env["MASTER_ADDR"] == "rel-greenroom-0.rel-greenroom"
    assert "NODE_RANK" in env
    assert shlex.split(env["GREENROOM_ARGS"])[:3] == ["--offload-train", "--offload-train-target", "disk"]


def kubelet_expand(text: str, env: dict) -> str:
    """The kubelet's $(VAR) expansion of command and args from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def test_the_rendered_trainer_container_runs_the_script_as_two_ranks(tmp_path):
    scratch = tmp_path / "offload"
    scratch.mkdir()
    trainer = rendered_trainer(
        "ephemeral",
        f"storage.mountPath={scratch}",
        "nodes=1",
        f"command={{{sys.executable},{SCRIPT}}}",
        f"args={{{tmp_path / 'out'},--steps=2}}",
    )
    downward = {
        "NODE_RANK": "0",
        "GREENROOM_JOB_ID": "job-uid-1",
        "GREENROOM_POD_UID": "pod-uid-1",
        "GREENROOM_POD_NAME": "rel-greenroom-0-abcde",
        "GREENROOM_POD_NAMESPACE": "train",
        "GREENROOM_NODE_NAME": "node-1",
    }
    env = {}
    for e in trainer["env"]:
        env[e["name"]] = e["value"] if "value" in e else downward[e["name"]]
    env["MASTER_ADDR"] = "127.0.0.1"
    argv = [kubelet_expand(a, env) for a in trainer["command"] + trainer["args"]]
    assert argv[:2] == ["greenroom", "torchrun"]
    launcher = shutil.which("greenroom")
    argv[:1] = [launcher] if launcher else [sys.executable, "-m", "greenroom.cli.main"]
    run_env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
        **env,
        "OMP_NUM_THREADS": "1",
    }
    out = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 step 2: slept" in text, text[-4000:]
    # Each rank's dir went when it closed; nothing is left in the pod's volume.
    assert not [p for p in scratch.rglob("*") if p.is_file()]


@pytest.mark.parametrize(
    "greenroom_args", ["--offload-train --offload-train-target cpu", ""], ids=["cpu target", "no flags"]
)
def test_the_script_runs_where_no_mechanism_writes_to_disk(tmp_path, greenroom_args):
    """The chart's default offload.target is cpu, and a user may set no seed flags: the
    script must not open a RankDir on the unresolved disk dir (None) and die with a
    TypeError. It opens one only where config.uses_disk, and a RankDir without a root is
    one line naming the flag."""
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(REPO, "runtime"),
        "GREENROOM_ARGS": greenroom_args,
        "GREENROOM_DISK_DIR": str(tmp_path / "disk"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    out = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path / "out"), "--steps", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("slept") == 2 and not (tmp_path / "disk").exists()


def test_a_rank_dir_without_a_root_is_one_line():
    from greenroom.dirs.rankdir import RankDir
    from greenroom.errors import ConfigError

    with pytest.raises(ConfigError, match="RankDir: no root dir: pass --offload-train-disk-dir DIR") as info:
        RankDir(None)
    assert "\n" not in str(info.value)
