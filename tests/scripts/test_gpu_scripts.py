"""The scripts that carry the GPU machine's missing packages (scripts/gpu/): shellcheck,
and the one-line refusal of bad use. Downloading needs the package index and installing
needs the GPU machine's Python 3.12, so neither runs here."""

import subprocess

from tests.conftest import REPO, require_tool

SCRIPTS = ["scripts/gpu/carry.sh", "scripts/gpu/env.sh"]


def test_gpu_scripts_pass_shellcheck():
    shellcheck = require_tool("shellcheck")
    out = subprocess.run([shellcheck, "-x", *SCRIPTS], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_carry_refuses_an_unknown_flag_in_one_line_and_downloads_nothing(tmp_path):
    out = subprocess.run(
        ["bash", "scripts/gpu/carry.sh", "--all"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert out.returncode == 2
    assert out.stderr == "usage: scripts/gpu/carry.sh [--deepspeed]\n"
    assert not (tmp_path / ".cache").exists()
