"""The test cluster's scripts themselves, without a cluster: shellcheck, and the one-line
refusals of bad use."""

import os
import subprocess

from tests.conftest import REPO, require_tool

SCRIPTS = ["scripts/services.d/k8s.sh", "scripts/k8s/build.sh", "scripts/k8s/pki.sh", "scripts/k8s/node.sh",
           "scripts/k8s/jobset.sh", "scripts/k8s/dns.sh", "scripts/k8s/proxy.sh", "scripts/k8s/image.sh", "scripts/k8s/prune-images.sh", "scripts/setup.d/50-k8s.sh"]


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
    out = subprocess.run(["bash", "scripts/k8s/build.sh"], cwd=REPO, capture_output=True, text=True,
                         env={"PATH": str(bin_dir), "HOME": str(tmp_path)})
    assert out.returncode == 3
    assert out.stderr.count("\n") == 1 and "go not found on PATH" in out.stderr


def test_prune_images_refuses_a_call_without_a_prefix_in_one_line():
    # Without a prefix it would not know which tags are its own to remove.
    out = subprocess.run(["bash", "scripts/k8s/prune-images.sh", "/no/socket", "localhost/greenroom:ci-x"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr == "usage: scripts/k8s/prune-images.sh CONTAINERD_SOCKET KEEP_IMAGE PREFIX...\n"
