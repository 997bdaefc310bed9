"""Values that render a job that runs, but not the one meant: refused where greenroom knows
(its own trainer), warned of in NOTES.txt where the user's trainer decides (real helm)."""

import pytest

from tests.chart.support import CHART, helm, manifests, reject

pytestmark = pytest.mark.helm


def notes(*sets: str) -> str:
    argv = ["install", "rel", CHART, "--dry-run=client", "--namespace", "train"]
    for s in sets:
        argv += ["--set", s]
    out = helm(*argv)
    assert out.returncode == 0, out.stderr
    return out.stdout[out.stdout.index("NOTES:") :]


@pytest.mark.parametrize("gpus, procs", [(8, 1), (4, 2)])
def test_more_gpus_than_greenroom_train_processes_is_refused(gpus, procs):
    err = reject(f"gpu.count={gpus}", f"procsPerNode={procs}")
    assert (
        f"gpu.count {gpus} with procsPerNode {procs}: greenroom train uses one GPU per process, so "
        f"{gpus - procs} of each pod's GPUs would sit idle; set procsPerNode {gpus}"
    ) in err
    manifests(sets=(f"gpu.count={gpus}", f"procsPerNode={gpus}"))  # one process per GPU renders


def test_more_gpus_than_processes_of_your_command_is_warned_of():
    text = notes("command={python,t.py}", "image.repository=me/trainer", "gpu.count=8")
    assert (
        "WARNING: each pod gets 8 GPUs and runs 1 process(es) of your command: unless each process drives "
        "several GPUs itself, set procsPerNode 8"
    ) in text
    assert "WARNING" not in notes(
        "command={python,t.py}", "image.repository=me/trainer", "gpu.count=8", "procsPerNode=8"
    )


def test_your_command_in_greenrooms_own_image_is_warned_of():
    text = notes("command={python,t.py}")
    assert (
        "WARNING: command python ... runs in greenroom's own image (greenroom:0.1.0), which holds greenroom, "
        "not your trainer: set image.repository and image.tag"
    ) in text
    assert "WARNING" not in notes("command={python,t.py}", "image.repository=me/trainer")
    assert "WARNING" not in notes()
