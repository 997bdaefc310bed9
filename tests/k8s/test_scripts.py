"""The test cluster's scripts themselves, without a cluster: shellcheck, and the one-line
refusals of bad use; and the image import's refusal of a disk without room for it, into a
containerd of the test's own."""

import os
import shutil
import subprocess
import tempfile

import pytest

from tests.conftest import REPO, require_tool
from tests.k8s.support import require_cluster, wait_until

SCRIPTS = [
    "scripts/services.d/k8s.sh",
    "scripts/k8s/build.sh",
    "scripts/k8s/pki.sh",
    "scripts/k8s/node.sh",
    "scripts/k8s/jobset.sh",
    "scripts/k8s/dns.sh",
    "scripts/k8s/proxy.sh",
    "scripts/k8s/image.sh",
    "scripts/k8s/prune-images.sh",
    "scripts/setup.d/50-k8s.sh",
]


def test_cluster_scripts_pass_shellcheck():
    shellcheck = require_tool("shellcheck")
    out = subprocess.run([shellcheck, "-x", *SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_service_script_refuses_an_unknown_action_in_one_line():
    out = subprocess.run(["bash", "scripts/services.d/k8s.sh", "restart"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr == "usage: scripts/services.d/k8s.sh start|stop|env\n"


def test_build_says_what_is_missing_without_go(tmp_path):
    # A PATH with bash and coreutils but no go.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        os.symlink(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip(), bin_dir / tool)
    out = subprocess.run(
        ["bash", "scripts/k8s/build.sh"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
    )
    assert out.returncode == 3
    assert out.stderr.count("\n") == 1 and "go not found on PATH" in out.stderr


def test_prune_images_refuses_a_call_without_a_prefix_in_one_line():
    # Without a prefix it would not know which tags are its own to remove.
    out = subprocess.run(
        ["bash", "scripts/k8s/prune-images.sh", "/no/socket", "localhost/greenroom:ci-x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr == "usage: scripts/k8s/prune-images.sh CONTAINERD_SOCKET KEEP_IMAGE PREFIX...\n"


@pytest.mark.parametrize("short_by", ["margin", "imports in flight"])
def test_image_import_without_room_is_refused_in_one_line_and_imports_nothing(short_by):
    # The image the cluster's start built (podman has it), imported into a containerd of
    # this test's own, never the cluster's store. A margin no disk has stands for a full
    # disk; so does another import in flight (this test's own pid, alive) that holds more
    # than any disk has.
    require_cluster("image")
    containerd, ctr = require_tool("containerd"), require_tool("ctr")
    work = tempfile.mkdtemp(prefix="grc-", dir="/tmp")  # a socket path must stay short
    sock = os.path.join(work, "containerd.sock")
    store = os.environ.get("GREENROOM_K8S_CACHE", os.path.expanduser("~/.cache/greenroom-k8s"))
    held = os.path.join(store, ".imports", str(os.getpid()))
    with open(os.path.join(work, "config.toml"), "w") as f:
        f.write(
            f'version = 2\nroot = "{work}/root"\nstate = "{work}/state"\n'
            f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{sock}"\n'
        )
    daemon = subprocess.Popen(
        [containerd, "--config", os.path.join(work, "config.toml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        listing = [ctr, "--address", sock, "--namespace", "k8s.io"]
        wait_until(
            "the test's own containerd answering or gone",
            lambda: (
                daemon.poll() is not None or subprocess.run([*listing, "version"], capture_output=True).returncode == 0
            ),
            timeout=30,
        )
        assert daemon.poll() is None, "the test's own containerd exited at its start"
        env = dict(os.environ)
        if short_by == "margin":
            env["GREENROOM_K8S_FREE_MARGIN_GB"] = "1000000000"
        else:
            os.makedirs(os.path.dirname(held), exist_ok=True)
            with open(held, "w") as f:
                f.write(f"{10**18}\n")
        out = subprocess.run(["bash", "scripts/k8s/image.sh", sock], cwd=REPO, capture_output=True, text=True, env=env)
        assert out.returncode == 1, out.stderr
        (line,) = out.stdout.splitlines()
        assert line.startswith("not imported: ") and "GREENROOM_K8S_FREE_MARGIN_GB" in line, line
        assert ("more for the imports in flight" in line) == (short_by != "margin"), line
        # The refused import holds no room of its own (the lock file aside).
        holders = [n for n in os.listdir(os.path.dirname(held)) if not n.startswith(".")]
        assert holders == ([os.path.basename(held)] if short_by != "margin" else [])
        assert subprocess.run([*listing, "images", "ls", "-q"], capture_output=True, text=True).stdout == ""
        assert subprocess.run([*listing, "content", "ls", "-q"], capture_output=True, text=True).stdout == ""
    finally:
        if os.path.exists(held):
            os.unlink(held)
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(work)
