"""docs/slurm.md's config reference is the job YAML's own definition, and a misspelt key
is answered with the key it was probably meant to be."""

import dataclasses
import os
import subprocess
import sys

import pytest

from greenroom.errors import ConfigError
from greenroom.slurm.config import SlurmJobConfig, TrainArgs, config_from_dict
from greenroom.slurm.reference import SECTIONS, table
from tests.cli_support import REPO

SCRIPT = os.path.join(REPO, "scripts", "slurm-config-table.py")


def test_docs_slurm_md_holds_the_generated_config_reference():
    proc = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_reference_names_every_key_with_its_default_and_unit():
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ")[1:] for line in table().splitlines()[2:]}
    keys = [f"{prefix}{f.name}" for prefix, cls in SECTIONS for f in dataclasses.fields(cls)]
    assert list(rows) == keys
    default, unit, meaning = rows["cpus_per_task"]
    assert default == "`null`" and unit == "CPUs per Slurm task"
    assert "as Slurm means it" in meaning and "`tasks_per_node` with torchrun" in meaning
    assert rows["preempt_signal_seconds"][:2] == ["`120`", "seconds"]
    assert rows["train.offload_train_disk_chunk_mb"][:2] == [f"`{TrainArgs().offload_train_disk_chunk_mb}`", "MiB"]
    assert rows["time"][0] == f"`{SlurmJobConfig().time}`"
    assert rows["container.image"][0] == "required"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"gpus_per_nod": 8}, "unknown key 'gpus_per_nod': did you mean 'gpus_per_node'? known keys: "),
        ({"cpus_per_tsk": 8}, "unknown key 'cpus_per_tsk': did you mean 'cpus_per_task'? known keys: "),
        ({"train": {"offload_trian": True}}, "unknown key 'train.offload_trian': did you mean 'train.offload_train'? "),
        (
            {"container": {"runtime": "pyxis", "image": "x", "mount": []}},
            "unknown key 'container.mount': did you mean 'container.mounts'? ",
        ),
    ],
)
def test_misspelt_key_names_the_closest_known_key(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_unlike_any_key_lists_the_known_keys_without_a_guess():
    with pytest.raises(ConfigError, match=r"^unknown key 'zzz'; known keys: account, command, ") as e:
        config_from_dict({"zzz": 1})
    assert "did you mean" not in str(e.value)
