"""The container image: built by `make image`'s script with podman on a real Debian base,
then one container of it run with podman (runc), greenroom executed inside it.

No registry is reachable in CI, so the NGC base cannot be pulled: the base is a Debian
bookworm made with debootstrap (images/ci-base.sh, cached under .tools/), and PyPI's torch
(the CUDA build, which imports on a CPU machine) with its nvidia-* runtime wheels and every
dependency are staged on the host (images/stage_wheels.py, ~/.cache/greenroom-k8s/wheels)
and installed from there (no index inside the build). The image is the one the Kubernetes
test cluster's pods run: images/ci-image.sh builds it once, tagged by a hash of its
sources, and both this test and scripts/k8s/image.sh use that build (a warm run builds
nothing). The production base keeps its own torch; that path is the same Dockerfile with a
torch already installed, which this test does not exercise.
"""

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from greenroom.io import fs
from tests.conftest import REPO, require_tool

pytestmark = pytest.mark.image

BASE = "localhost/greenroom-ci-base:bookworm-2"
# This machine: vfs storage and chroot isolation (overlay and the default isolation fail
# on its hybrid cgroups); runc, because crun fails on rlimits here.
ENV = dict(os.environ, STORAGE_DRIVER="vfs", BUILDAH_ISOLATION="chroot")
# One container of the image for the module: with vfs storage each container is a full
# copy of the image's GBs (tens of seconds), so the tests run their commands in this one
# with `podman exec`, each as the user it names (the image's own by default).
CREATE = [
    "podman",
    "--runtime",
    "runc",
    "create",
    "--network",
    "none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
]


@pytest.fixture(scope="module")
def image():
    """The CI image, built by images/ci-image.sh unless podman already has its tag."""
    require_tool("podman")
    require_tool("runc")
    if subprocess.run(["podman", "image", "exists", BASE], env=ENV).returncode != 0:
        require_tool("debootstrap")
    build = subprocess.run(["bash", "images/ci-image.sh"], cwd=REPO, capture_output=True, text=True, env=ENV)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    return build.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def container(image, tmp_path_factory):
    """A running container of the image (as its own user, idle), with a host dir mounted
    at /data: ``(name, host dir)``. Removed after the module."""
    data = tmp_path_factory.mktemp("data")
    if fs.is_memory_backed(str(data)):  # a real disk, as disk_dir gives
        data = os.path.join(REPO, ".run", "test-tmp", f"image-{uuid.uuid4().hex[:12]}")
        os.makedirs(data)
    os.chmod(data, 0o755)  # the image's user (uid 1000) reaches the dirs the tests make in it
    name = f"greenroom-test-{uuid.uuid4().hex[:12]}"
    create = subprocess.run(
        [*CREATE, "--name", name, "-v", f"{data}:/data", image, "sleep", "infinity"],
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert create.returncode == 0, create.stderr
    try:
        start = subprocess.run(["podman", "start", name], env=ENV, capture_output=True, text=True)
        assert start.returncode == 0, start.stderr
        yield name, str(data)
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], env=ENV, capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def _run(container, *argv, user=None):
    """``argv`` run in the module's container, as ``user`` where given."""
    cmd = ["podman", "exec"]
    if user:
        cmd += ["--user", user]
    return subprocess.run([*cmd, container[0], *argv], env=ENV, capture_output=True, text=True)


def test_image_has_oci_labels_and_a_non_root_user(image):
    info = json.loads(
        subprocess.run(
            ["podman", "image", "inspect", image], env=ENV, check=True, capture_output=True, text=True
        ).stdout
    )[0]
    labels = info["Labels"]
    assert labels["org.opencontainers.image.title"] == "greenroom"
    assert labels["org.opencontainers.image.version"] == "0.1.0"
    assert labels["org.opencontainers.image.base.name"] == BASE
    assert info["Config"]["User"] == "1000:1000"


def test_greenroom_version_runs_in_the_image(container):
    out = _run(container, "greenroom", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "greenroom 0.1.0"
    # The container runs as the image's user: the one the train test below writes as.
    assert _run(container, "id", "-u").stdout.strip() == "1000"


def test_reclaim_dry_run_in_the_image_sees_a_dead_ranks_dir_and_keeps_it(container):
    root = os.path.join(container[1], "reclaim")
    dead = os.path.join(root, "job1", "actor", "rank00000")
    os.makedirs(dead)
    with open(os.path.join(dead, "owner.json"), "w") as f:
        json.dump({"pid": 999999, "host": "gone", "job": "job1", "role": "actor", "rank": 0}, f)
    open(os.path.join(dead, ".lock"), "w").close()
    # As root, like the chart's init container that runs reclaim on a node root.
    out = _run(container, "greenroom", "reclaim", "--dry-run", "--json", "/data/reclaim", user="0:0")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["dry_run"] is True
    assert [d["action"] for d in report["decisions"]] == ["would-reclaim"]
    assert os.path.isdir(dead)


def test_one_iteration_of_greenroom_train_with_disk_offload_into_a_host_dir(container):
    host = os.path.join(container[1], "train")
    os.makedirs(host)
    os.chmod(host, 0o777)  # the image's user is uid 1000
    out = _run(
        container,
        "greenroom",
        "train",
        "--iterations",
        "1",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        "/data/train/offload",
        "--stream-optimizer-state-to-disk",
        "--no-progress",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "offload disk" in out.stdout
    # The rank wrote its files under the mounted dir and removed them at exit.
    assert os.path.isdir(os.path.join(host, "offload"))
    assert glob.glob(os.path.join(host, "offload", "*", "actor", "rank*")) == []


def test_image_scripts_pass_shellcheck():
    shellcheck = require_tool("shellcheck")
    scripts = [
        "scripts/build-image.sh",
        "images/ci-base.sh",
        "images/ci-image.sh",
        "scripts/setup.d/20-helm.sh",
        "scripts/setup.d/30-containers.sh",
        "scripts/setup.d/10-slurm.sh",
        "scripts/lib/apt-install.sh",
    ]
    # -x follows the shared apt helper the setup steps source.
    out = subprocess.run([shellcheck, "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "usage: scripts/build-image.sh IMAGE:TAG BASE_IMAGE"),  # a missing argument
        (["x:1", "base"], "build-image: GREENROOM_BUILD_ENGINE=kaniko is not docker, podman or buildah"),
    ],
)
def test_build_script_refuses_bad_input_in_one_line(argv, message):
    env = dict(os.environ, GREENROOM_BUILD_ENGINE="kaniko")
    out = subprocess.run(["scripts/build-image.sh", *argv], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == message


def test_build_script_refuses_a_wheel_dir_without_wheels_in_one_line(tmp_path):
    # Not `cp: cannot stat '.../*.whl'`, exit 1, after the build context is made.
    env = dict(os.environ, GREENROOM_BUILD_ENGINE="kaniko", GREENROOM_IMAGE_WHEELS=str(tmp_path))
    out = subprocess.run(["scripts/build-image.sh", "x:1", "base"], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"build-image: GREENROOM_IMAGE_WHEELS={tmp_path} holds no wheel (*.whl)"]


def test_ci_image_never_removes_a_container_with_an_old_tag(tmp_path):
    """images/ci-image.sh removes earlier ci- tags; with --force that removed the containers
    using them too (the test run of another checkout on this machine). Run against a fake
    podman (and a no-op wheel staging) in a copy of the script's tree: an old tag in use is
    left in place, one not in use goes, and the user's own tag is never named; a deps image
    of another tree goes after them."""
    tree = tmp_path / "tree"
    (tree / "images").mkdir(parents=True)
    subprocess.run(["cp", os.path.join(REPO, "images", "ci-image.sh"), str(tree / "images")], check=True)
    (tree / "images" / "stage_wheels.py").write_text(
        "import os, sys\nos.makedirs(sys.argv[1], exist_ok=True)\nopen(os.path.join(sys.argv[1], '.staged'), 'w')\n"
    )
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    calls = tmp_path / "podman-calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    podman = bin_dir / "podman"
    podman.write_text(f"""#!/bin/bash
echo "$*" >> {calls}
case "$1" in
  image) exit 0 ;;
  images) printf '%s\\n' localhost/greenroom:ci-inuse localhost/greenroom:ci-idle localhost/greenroom:0.1.0 \\
                 localhost/greenroom-ci-deps:0ld ;;
  rmi) [[ " $* " != *" --force "* && " $* " != *" -f "* ]] || echo FORCED >> {calls}
       [ "${{!#}}" != localhost/greenroom:ci-inuse ] || {{ echo "image used by container" >&2; exit 2; }} ;;
esac
""")
    podman.chmod(0o755)
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        GREENROOM_K8S_CACHE=str(tmp_path / "cache"),
        PYTHON=sys.executable,
    )
    out = subprocess.run(["bash", "images/ci-image.sh"], cwd=tree, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("localhost/greenroom:ci-")
    rmi = [line for line in calls.read_text().splitlines() if line.startswith("rmi") or line == "FORCED"]
    # Then the deps image (images/Dockerfile's deps stage) that is not this tree's.
    assert rmi == [
        "rmi localhost/greenroom:ci-inuse",
        "rmi localhost/greenroom:ci-idle",
        "rmi localhost/greenroom-ci-deps:0ld",
    ], rmi
    assert "ci-image: left localhost/greenroom:ci-inuse in place (a container uses it)" in out.stderr


def _stage_wheels_module():
    spec = importlib.util.spec_from_file_location("stage_wheels", os.path.join(REPO, "images", "stage_wheels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_staged_wheels_follow_torchs_cuda_extras_at_the_installed_versions():
    # PyPI's torch asks for cuda-toolkit[cublas,...]: the offline build needs the wheels
    # behind those extras too (the test cluster's image, scripts/k8s/image.sh).
    from importlib import metadata

    if not any(r.startswith("cuda-toolkit[") for r in metadata.requires("torch") or []):
        pytest.skip(f"torch {metadata.version('torch')} here is not PyPI's CUDA build (no cuda-toolkit extras)")
    pins = _stage_wheels_module().closure(["torch"])
    for name in ("torch", "cuda-toolkit", "nvidia-cublas", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "triton"):
        assert pins[name] == metadata.version(name), name


def test_staging_refuses_a_missing_distribution_in_one_line():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.path.insert(0, 'images'); import stage_wheels; "
            "stage_wheels.closure(['no-such-distribution-greenroom'])",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr == (
        "stage_wheels: no-such-distribution-greenroom (the image needs it) is not installed in "
        f"{sys.executable}: run make install\n"
    )


def test_the_dockerfile_installs_pinned_versions_only():
    """Every package the image build names is pinned with ==, at the version the test extra
    pins, not a range (megatron-core>=0.16.1 takes whatever the index has on the day)."""
    import re

    import tomllib

    text = open(os.path.join(REPO, "images", "Dockerfile"), encoding="utf-8").read().replace("\\\n", " ")
    (install,) = [line for line in text.splitlines() if "pip install --find-links" in line]
    named = re.findall(r'"([A-Za-z][A-Za-z0-9_.-]*[^"]*)"', install.split("pip install --find-links", 1)[1])
    assert named and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9A-Za-z.]*", n) for n in named), named
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    pins = [r.split(";")[0].strip() for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    assert set(named) <= set(pins), set(named) - set(pins)
