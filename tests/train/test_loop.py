"""``greenroom train`` end to end on the CPU: real processes, real files, torchrun.

Every combination of the seed's rules that is allowed runs a few iterations with one
rank; DDP and FSDP2 run with two ranks under torchrun (gloo); a run resumed from
``--save`` ends bit-identical to the same run done in one go; every per-rank file is
gone at the end.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from greenroom.train import rotation
from tests.cli_support import greenroom_forked

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = [
    "--iterations",
    "3",
    "--prompts",
    "8",
    "--group-size",
    "4",
    "--minibatches",
    "2",
    "--d-model",
    "32",
    "--no-progress",
]


def streaming_available() -> bool:
    try:
        from greenroom.optim import StreamingAdam  # noqa: F401
    except ImportError:
        return False
    return True


needs_streaming = pytest.mark.skipif(
    not streaming_available(), reason="greenroom.optim.StreamingAdam does not import here"
)


def env():
    return {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime"), "OMP_NUM_THREADS": "1"}


def train(args, *, ranks=1, check=True):
    """``greenroom train args`` to its end: one rank in a process of its own, forked from a
    Python that has imported torch already; ``ranks`` under torchrun in a subprocess."""
    if ranks == 1:
        result = greenroom_forked("train", *args, env=env(), timeout=300, cwd=REPO)
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "-m",
            "greenroom.cli.main",
            "train",
            *args,
        ]
        result = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


COMBINATIONS = {
    "resident": [],
    "offload-cpu": ["--offload-train"],
    "offload-disk": ["--offload-train", "--offload-train-target", "disk"],
    "offload-disk+streaming": ["--offload-train", "--offload-train-target", "disk", "--stream-optimizer-state-to-disk"],
    "streaming-alone": ["--stream-optimizer-state-to-disk"],
    "offload-disk+streaming-bf16": [
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--stream-optimizer-state-moment-dtype",
        "bf16",
    ],
}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_every_allowed_combination_trains_and_reclaims_its_files(disk_dir, name):
    flags = COMBINATIONS[name]
    if "--stream-optimizer-state-to-disk" in flags and not streaming_available():
        pytest.skip("greenroom.optim.StreamingAdam does not import here")
    root = os.path.join(disk_dir, "offload")
    metrics = os.path.join(disk_dir, "m.jsonl")
    result = train([*SMALL, *flags, "--offload-train-disk-dir", root, "--metrics", metrics])
    lines = [line for line in result.stdout.splitlines() if line.startswith("iter ")]
    assert len(lines) == 3 and all("reward" in line and "sleep" in line and "B/s" in line for line in lines)
    rows = records(metrics)
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    offloading = "--offload-train" in flags
    assert all((r["sleep_bytes"] > 0) == offloading for r in rows)
    assert {e["phase"] for e in rows[0]["events"]} == {"sync", "sleep", "rollout", "wake", "train"}
    if os.path.exists(root):
        assert os.listdir(root) == [], "per-rank files left behind"


def test_a_rule_violation_exits_2_with_one_line(disk_dir):
    result = train(
        [*SMALL, "--offload-train", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir", disk_dir],
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "greenroom train: error: --stream-optimizer-state-to-disk under --offload-train requires "
        "--offload-train-target disk: a run that cannot hold its optimizer state on the GPU will not hold a "
        "pinned host copy of the whole actor either"
    ]


def test_default_run_learns(disk_dir):
    """The `make run` shape, shortened: reward rises well above chance (0.1)."""
    metrics = os.path.join(disk_dir, "m.jsonl")
    flags = [
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
        "--iterations",
        "40",
        "--no-progress",
        "--metrics",
        metrics,
    ]
    if streaming_available():
        flags.append("--stream-optimizer-state-to-disk")
    result = train(flags)
    rows = records(metrics)
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[:5]) / 5 < 0.15
    assert sum(rewards[-5:]) / 5 > 0.3
    if streaming_available():
        # Both mechanisms move real bytes every iteration: the bf16 matrices' fp32 masters
        # and moments stream (4 optimizer steps, the first reading the whole state; each
        # leaves its last bucket on the device for the next, and the sleep writes the last
        # one back: optim.store.held Note [the last bucket stays]), the sleeping actor goes to
        # disk, and the rank dir holds the files.
        header = result.stdout.splitlines()[0]
        assert "params stream (" in header and "stay resident" in header and "WARNING" not in header
        for previous, r in zip([None, *rows], rows):
            # The sleep writes back the bucket the previous iteration's last step kept.
            assert r["stream_sleep_written_bytes"] == (previous["stream_kept_bytes"] if previous else 0)
            assert r["stream_read_bytes"] - r["stream_kept_bytes"] == (
                r["stream_written_bytes"] - r["stream_sleep_written_bytes"]
            )
            assert r["stream_kept_bytes"] > 0
            assert r["stream_disk_read_bytes"] > 0 and r["disk_stored_bytes"] > 0 and r["offloaded_bytes"] > 0
        assert all("streamed read" in line for line in result.stdout.splitlines() if line.startswith("iter "))


@needs_streaming
def test_the_lines_count_the_write_back_of_the_kept_bucket_at_sleep(disk_dir):
    """Every iteration after the first writes the optimizer state back when the actor
    sleeps (the bucket the last step kept on the device): the line and the record count it
    where the steps alone wrote nothing, and the header says when it happens."""
    metrics = os.path.join(disk_dir, "m.jsonl")
    result = train(
        [
            *SMALL,
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--stream-optimizer-state-to-disk",
            "--offload-train-disk-dir",
            os.path.join(disk_dir, "o"),
            "--offload-train-disk-compression",
            "none",
            "--metrics",
            metrics,
        ]
    )
    header, *lines = result.stdout.splitlines()
    assert "read and written back every optimizer step" not in header
    assert "is written back when the actor sleeps, the run saves or it ends" in header
    rows = records(metrics)
    state = rows[0]["stream_read_bytes"]
    assert state > 0 and rows[0]["stream_kept_bytes"] == state  # one bucket: kept after every step
    for r in rows[1:]:
        assert r["stream_written_bytes"] == r["stream_sleep_written_bytes"] == state
    iterations = [line for line in lines if line.startswith("iter ")]
    assert "written 0 B" in iterations[0]
    shown = f"{state / 1e3:.1f} KB"  # --d-model 32: 274.4 KB of state
    for line in iterations[1:]:
        assert f"streamed read {shown} written {shown} ({shown} of it at sleep, steps " in line
    assert "0.00 GB/s" not in result.stdout
    # The last iteration's kept bucket is written back as the run closes, and said.
    assert (
        f"exit: {shown} of streamed optimizer state written back (the bucket the last step kept on the device)"
        in result.stdout
    )


@needs_streaming
def test_the_header_warns_when_nothing_streams(disk_dir):
    # fp32 params this small all stay resident under the small-param rule.
    result = train(
        [
            *SMALL[2:],
            "--iterations",
            "1",
            "--dtype",
            "fp32",
            "--stream-optimizer-state-to-disk",
            "--offload-train-disk-dir",
            os.path.join(disk_dir, "o"),
            "--metrics",
            os.path.join(disk_dir, "m.jsonl"),
        ]
    )
    assert "0 params stream" in result.stdout and "WARNING: nothing streams" in result.stdout
    assert "no masters (fp32 params are their own)" in result.stdout  # not the flag's layout, which is for bf16
    assert records(os.path.join(disk_dir, "m.jsonl"))[0]["stream_read_bytes"] == 0


@needs_streaming
def test_the_master_layout_flag_reaches_the_optimizer(disk_dir):
    # bf16 matrices stream: as remainders (the default) 2 B/param of master, whole 4 B.
    read = {}
    for layout in ("remainder", "fp32"):
        metrics = os.path.join(disk_dir, f"{layout}.jsonl")
        result = train(
            [
                *SMALL[2:],
                "--iterations",
                "1",
                "--stream-optimizer-state-to-disk",
                "--stream-optimizer-state-master-layout",
                layout,
                "--offload-train-disk-dir",
                os.path.join(disk_dir, layout),
                "--metrics",
                metrics,
            ]
        )
        words = {"remainder": "masters as remainders)", "fp32": "masters whole)"}[layout]
        assert words in result.stdout.splitlines()[0]
        read[layout] = records(metrics)[0]["stream_read_bytes"]
    assert 0 < read["remainder"] < read["fp32"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_under_torchrun_each_with_its_own_dir(disk_dir, parallel):
    root = os.path.join(disk_dir, "offload")
    flags = ["--offload-train", "--offload-train-target", "disk"]
    if streaming_available():
        flags.append("--stream-optimizer-state-to-disk")
    result = train(
        [
            *SMALL,
            *flags,
            "--offload-train-disk-dir",
            root,
            "--parallel",
            parallel,
            "--metrics",
            os.path.join(disk_dir, "m.jsonl"),
        ],
        ranks=2,
    )
    assert "2 rank(s)" in result.stdout
    assert "rank00000" in result.stdout
    assert records(os.path.join(disk_dir, "m.jsonl"))[-1]["world_size"] == 2
    assert os.listdir(root) == []


def load_state(directory, rank=0):
    """A checkpoint's weights and resident optimizer state; ``directory`` a --save root
    (its newest iteration) or one checkpoint dir."""
    path = os.path.join(rotation.candidates(directory)[0], f"rank{rank:05d}")
    model = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    optim = None
    if os.path.exists(os.path.join(path, "optim.pt")):
        optim = torch.load(os.path.join(path, "optim.pt"), weights_only=False)
    return model, optim


def assert_same_state(a, b):
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    if optim_a is not None:
        for p, state in optim_a["state"].items():
            for k, v in state.items():
                assert torch.equal(local(v), local(optim_b["state"][p][k])), (p, k)


def local(t):
    # FSDP2's optimizer state is DTensors: compare this rank's shard, no collectives.
    return getattr(t, "_local_tensor", t)


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--offload-train", "--offload-train-target", "disk"], id="offload-disk"),
        pytest.param(
            ["--offload-train", "--offload-train-target", "disk", "--stream-optimizer-state-to-disk"],
            id="offload-disk+streaming",
            marks=needs_streaming,
        ),
    ],
)
def test_resume_from_save_is_bit_exact(disk_dir, flags):
    base = [
        *SMALL[2:],
        *flags,
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
    ]
    straight, first, resumed = (os.path.join(disk_dir, n) for n in ("straight", "first", "resumed"))
    train([*base, "--iterations", "4", "--save", straight])
    train([*base, "--iterations", "2", "--save", first])
    result = train([*base, "--iterations", "4", "--load", first, "--save", resumed])
    assert "resuming at iteration 3" in result.stdout
    assert_same_state(load_state(straight), load_state(resumed))
    if "--stream-optimizer-state-to-disk" in flags:
        # The streamed state is only readable with streaming on.
        refused = train([*base, "--iterations", "5", "--load", resumed], check=False)
        assert refused.returncode == 0, refused.stderr
        without = [f for f in base if f != "--stream-optimizer-state-to-disk"]
        refused = train([*without, "--iterations", "5", "--load", resumed], check=False)
        assert refused.returncode == 2 and "--no-load-optim" in refused.stderr


# A greenroom whose StreamingAdam defaults to buckets of 2e8 elements, not DEFAULT_BUCKET_NUMEL.
OLD_DEFAULT = (
    "import sys; from greenroom.optim import StreamingAdam; "
    "StreamingAdam.__init__.__kwdefaults__['bucket_numel'] = 200_000_000; "
    "from greenroom.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@needs_streaming
def test_a_checkpoint_saved_with_the_old_default_bucket_size_resumes_bit_exactly(disk_dir):
    base = [
        *SMALL[2:],
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
    ]
    straight, first, resumed = (os.path.join(disk_dir, n) for n in ("straight", "first", "resumed"))
    train([*base, "--iterations", "4", "--save", straight])
    old = subprocess.run(
        [sys.executable, "-c", OLD_DEFAULT, "train", *base, "--iterations", "2", "--save", first],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert old.returncode == 0, old.stderr[-3000:]
    with open(
        os.path.join(rotation.candidates(first)[0], "rank00000", "optim", "manifest.json"), encoding="utf-8"
    ) as f:
        assert json.load(f)["layout"]["bucket_numel"] == 200_000_000
    result = train([*base, "--iterations", "4", "--load", first, "--save", resumed])
    assert "resuming at iteration 3" in result.stdout
    assert_same_state(load_state(straight), load_state(resumed))


@needs_streaming
def test_host_cache_trains_and_resumes_bit_identically_to_streaming_without_it(disk_dir):
    # bf16 params: every param streams (fp32 ones this small would stay resident).
    base = [
        *SMALL[2:],
        "--dtype",
        "bf16",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
    ]
    cache = ["--stream-optimizer-state-host-cache-gb", "1"]
    plain, first, resumed = (os.path.join(disk_dir, n) for n in ("plain", "first", "resumed"))
    train([*base, "--iterations", "4", "--save", plain])
    header = train([*base, *cache, "--iterations", "2", "--save", first]).stdout.splitlines()[0]
    assert "host cache 1 of 1 buckets" in header and "disk 0 GB each way per step" in header
    train([*base, *cache, "--iterations", "4", "--load", first, "--save", resumed])
    assert_same_state(load_state(plain), load_state(resumed))
    optim = [os.path.join(rotation.candidates(d)[0], "rank00000", "optim") for d in (plain, resumed)]
    names = sorted(n for n in os.listdir(optim[0]) if n.startswith("bucket-"))
    assert names == sorted(n for n in os.listdir(optim[1]) if n.startswith("bucket-")) and names
    for name in names:  # the streamed state, byte for byte (written out of the cache at the save)
        with open(os.path.join(optim[0], name), "rb") as a, open(os.path.join(optim[1], name), "rb") as b:
            assert a.read() == b.read(), name
    # Too small for the bucket: said in the header, and nothing is cached.
    header = train([*base, "--stream-optimizer-state-host-cache-gb", "1e-6", "--iterations", "1"]).stdout
    assert "host cache 1e-06 GB holds no bucket" in header and "every bucket streams from disk" in header
    assert os.listdir(os.path.join(disk_dir, "offload")) == []


def test_loading_with_another_world_size_is_refused(disk_dir):
    save = os.path.join(disk_dir, "ckpt")
    train([*SMALL, "--save", save, "--metrics", os.path.join(disk_dir, "m.jsonl")])
    from greenroom.io.publish import read_checked_json, write_checked_json

    newest = rotation.candidates(save)[0]
    meta = read_checked_json(os.path.join(newest, "meta.json"), {})
    meta["world_size"] = 2  # as a 2-rank run would have written it, checksum and all
    write_checked_json(os.path.join(newest, "meta.json"), meta)
    result = train(
        [*SMALL, "--iterations", "4", "--load", save, "--metrics", os.path.join(disk_dir, "m.jsonl")], check=False
    )
    assert result.returncode == 2
    assert "saved with 2 ranks, this run has 1; resume is same-topology only" in result.stderr


def test_no_load_optim_resumes_weights_with_a_fresh_optimizer_and_a_warning(disk_dir):
    save = os.path.join(disk_dir, "ckpt")
    metrics = os.path.join(disk_dir, "m.jsonl")
    train([*SMALL, "--save", save, "--metrics", metrics])
    result = train([*SMALL, "--iterations", "4", "--load", save, "--no-load-optim", "--metrics", metrics])
    assert "--no-load-optim: starting a fresh optimizer state" in result.stderr
    assert [r["iteration"] for r in records(metrics)] == [1, 2, 3, 4]


@pytest.mark.parametrize("ranks,parallel", [(1, "ddp"), (2, "fsdp")])
def test_offload_does_not_change_the_result(disk_dir, ranks, parallel):
    """The same run with the actor sleeping on disk every iteration and never sleeping
    ends with bit-identical weights and optimizer state on every rank."""
    common = [*SMALL, "--parallel", parallel, "--metrics", os.path.join(disk_dir, "m.jsonl")]
    resident, offloaded = os.path.join(disk_dir, "resident"), os.path.join(disk_dir, "offloaded")
    train([*common, "--save", resident], ranks=ranks)
    train(
        [
            *common,
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            os.path.join(disk_dir, "offload"),
            "--save",
            offloaded,
        ],
        ranks=ranks,
    )
    for rank in range(ranks):
        assert_same_state(load_state(resident, rank), load_state(offloaded, rank))


def test_sigterm_mid_run_reclaims_every_per_rank_file(disk_dir):
    import signal

    root = os.path.join(disk_dir, "offload")
    cmd = [
        sys.executable,
        "-m",
        "greenroom.cli.main",
        "train",
        *SMALL,
        "--iterations",
        "100000",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        root,
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
    ]
    child = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    for line in child.stdout:
        if line.startswith("iter "):
            break
    assert any(name.startswith("rank") for _, dirs, _ in os.walk(root) for name in dirs)
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM
    assert os.listdir(root) == []


@needs_streaming
def test_fp32_streaming_trains_bit_identically_to_resident_adamw(disk_dir):
    # fp32 params: AdamW on them is the reference the streamed fp32 state must equal.
    common = [
        *SMALL,
        "--dtype",
        "fp32",
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
    ]
    resident, streamed = os.path.join(disk_dir, "resident"), os.path.join(disk_dir, "streamed")
    train([*common, "--save", resident])
    train([*common, "--stream-optimizer-state-to-disk", "--save", streamed])
    model_a, optim_a = load_state(resident)
    model_b, _ = load_state(streamed)
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    # The optimizer state too: the streamed checkpoint, read back into a StreamingAdam over
    # the same model, equals resident AdamW's state entry by entry.
    import argparse

    from greenroom.cli.train import VOCAB_SIZE, configure_parser
    from greenroom.optim import StreamingAdam
    from greenroom.train.model import ModelConfig, Transformer
    from greenroom.train.task import TaskConfig

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(SMALL)
    model = Transformer(
        ModelConfig(
            vocab_size=VOCAB_SIZE,
            d_model=args.d_model,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            max_seq_len=TaskConfig(digits=args.digits).seq_len,
        )
    )
    model.load_state_dict(model_b)
    opt = StreamingAdam(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, state_dir=os.path.join(disk_dir, "reader")
    )
    try:
        opt.load_checkpoint(os.path.join(rotation.candidates(streamed)[0], "rank00000", "optim"))
        state_b = opt.state_dict()["state"]
        assert optim_a["state"].keys() == state_b.keys()
        for i, state in optim_a["state"].items():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], state_b[i][key]), (i, key)
    finally:
        opt.close()


@pytest.mark.parametrize("ranks", [1, 2])
def test_sigterm_with_save_checkpoints_first_and_the_rerun_resumes(disk_dir, ranks):
    """Slurm preemption: SIGTERM to every rank; with --save the run finishes its iteration,
    saves, exits 143, and the requeued run resumes from that iteration with --load."""
    import signal

    save = os.path.join(disk_dir, "ckpt")
    args = [
        *SMALL,
        "--iterations",
        "100000",
        "--save",
        save,
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
    ]
    if ranks == 1:
        cmd = [sys.executable, "-m", "greenroom.cli.main", "train", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "greenroom.cli.main",
            "train",
            *args,
        ]
    child = subprocess.Popen(
        cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    for line in child.stdout:
        if line.startswith("iter "):
            break
    os.killpg(child.pid, signal.SIGTERM)  # every rank gets it, as from scancel --signal=TERM
    out, err = child.communicate(timeout=120)
    assert "preempted: saved iteration" in out, err
    if ranks == 1:
        assert child.returncode == 128 + signal.SIGTERM
    meta = json.load(open(os.path.join(rotation.candidates(save)[0], "meta.json")))
    assert 0 < meta["iteration"] < 100000
    resumed = train(
        [
            *SMALL,
            "--iterations",
            str(meta["iteration"] + 1),
            "--load",
            save,
            "--metrics",
            os.path.join(disk_dir, "m2.jsonl"),
        ],
        ranks=ranks,
    )
    assert [r["iteration"] for r in records(os.path.join(disk_dir, "m2.jsonl"))] == [meta["iteration"] + 1]
    assert resumed.returncode == 0


def test_reference_policy_moves_untracked_and_consumed_grads_are_not_written(disk_dir):
    """--reference-policy: a frozen copy nobody tracks. Every sleep covers it (the run's
    weights match a resident twin's), and from the second sleep on the grads the last
    step consumed are dropped, not written."""
    metrics = os.path.join(disk_dir, "m.jsonl")
    common = [*SMALL, "--iterations", "3", "--reference-policy"]
    resident = os.path.join(disk_dir, "resident")
    train([*common, "--metrics", os.path.join(disk_dir, "r.jsonl"), "--save", resident])
    offloaded = os.path.join(disk_dir, "offloaded")
    result = train(
        [
            *common,
            "--metrics",
            metrics,
            "--save",
            offloaded,
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            os.path.join(disk_dir, "offload"),
        ]
    )
    assert "wrote " in result.stdout
    runs = records(metrics)
    # The first sleep has no grads (only all-zero biases are dropped); later ones drop
    # the consumed grads, as many bytes as the weights (fp32, same shapes).
    weights = runs[0]["sleep_bytes"] // 2  # the policy and its frozen reference
    assert runs[0]["sleep_dead"] < weights // 10
    for r in runs[1:]:
        assert r["sleep_dead"] >= weights
        assert r["sleep_written"] + r["sleep_dead"] + r["sleep_clean"] == r["sleep_bytes"]
    assert_same_state(load_state(resident, 0), load_state(offloaded, 0))


def test_resume_auto_starts_fresh_where_nothing_was_saved_and_resumes_after(disk_dir):
    """One command for the first run and every restart (the chart's and the templates'):
    --save DIR --load DIR --resume auto. Exact --load (the default, strict) stays strict,
    and under auto a dir that is there but is not a checkpoint is still refused."""
    ck = os.path.join(disk_dir, "ck")
    base = [
        *SMALL[2:],
        "--offload-train-disk-dir",
        os.path.join(disk_dir, "offload"),
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
        "--save",
        ck,
        "--load",
        ck,
    ]
    strict = train([*base, "--iterations", "2"], check=False)
    assert strict.returncode == 2 and f"--load {ck}: no such checkpoint dir" in strict.stderr
    first = train([*base, "--iterations", "2", "--resume", "auto"])
    assert "no checkpoint there yet (--resume auto): starting fresh" in first.stdout + first.stderr
    again = train([*base, "--iterations", "3", "--resume", "auto"])
    assert "resuming at iteration 3" in again.stdout
    junk = os.path.join(disk_dir, "junk")
    os.makedirs(junk)
    with open(os.path.join(junk, "data.txt"), "w") as f:
        f.write("not a checkpoint")
    refused = train([*SMALL, "--load", junk, "--resume", "auto"], check=False)
    assert refused.returncode == 2 and f"--load {junk}: no valid generation.json" in refused.stderr


def test_ctrl_c_in_the_loop_ends_in_one_line_with_130_and_leaves_no_files(disk_dir):
    # ^C while the actor sleeps on disk: the rank dir goes with the `with` blocks on the way
    # out, and the user gets one line, not a KeyboardInterrupt traceback.
    import signal

    from tests.cli_support import greenroom_stopped_at

    root = os.path.join(disk_dir, "o")
    os.makedirs(root)
    open(os.path.join(root, "mine.txt"), "w").close()
    proc = greenroom_stopped_at(
        "rollout",
        "train",
        *SMALL,
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        root,
        sigint=True,
    )
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "greenroom train: interrupted"
    assert os.listdir(root) == ["mine.txt"]


def test_metrics_never_overwrites_a_file_greenroom_did_not_write(disk_dir):
    """A fresh run must not truncate whatever --metrics names, nor a resumed one rewrite it
    without its lines that are not JSON (a user's notes would lose all but nothing, with a
    warning about "torn lines"). A file of greenroom's own, with a torn last line, is taken."""
    ck = os.path.join(disk_dir, "ck")
    metrics = os.path.join(disk_dir, "m.jsonl")
    train([*SMALL, "--iterations", "2", "--save", ck, "--metrics", metrics])
    notes = os.path.join(disk_dir, "notes.txt")
    for text in ("my notes\nline two\n", '{"iteration": "mine"}\n', "no newline"):
        with open(notes, "w") as f:
            f.write(text)
        for extra in ([], ["--load", ck]):
            result = train([*SMALL, "--iterations", "3", "--metrics", notes, *extra], check=False)
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            assert result.stderr.strip().splitlines() == [
                f"greenroom train: error: --metrics {notes}: line 1 is not a greenroom train metrics record, so "
                "greenroom did not write this file; refusing to overwrite it: give another path"
            ]
            with open(notes) as f:
                assert f.read() == text
    with open(metrics, "a") as f:
        f.write('{"iteration": 3, "iter')  # a run killed mid-write
    resumed = train([*SMALL, "--iterations", "3", "--load", ck, "--metrics", metrics])
    assert "dropped 1 torn line(s)" in resumed.stderr
    assert [r["iteration"] for r in records(metrics)] == [1, 2, 3]


def test_a_resume_rewrites_a_symlinked_metrics_files_target_not_the_link(disk_dir):
    """Dropping the records past the checkpoint replaced the link with a regular file: the
    target kept the stale records and the resumed run's went beside it."""
    ck = os.path.join(disk_dir, "ck")
    real = os.path.join(disk_dir, "real.jsonl")
    train([*SMALL, "--iterations", "2", "--save", ck, "--metrics", real])
    with open(real, "a") as f:
        f.write(json.dumps({"iteration": 3, "events": []}) + "\n")  # logged by a run killed before its save
    os.chmod(real, 0o640)
    link = os.path.join(disk_dir, "link.jsonl")
    os.symlink(real, link)
    train([*SMALL, "--iterations", "3", "--load", ck, "--metrics", link])
    assert os.path.islink(link) and os.readlink(link) == real
    assert [r["iteration"] for r in records(real)] == [1, 2, 3] and records(real)[2]["events"]
    assert os.stat(real).st_mode & 0o777 == 0o640
    assert sorted(os.listdir(disk_dir)) == ["ck", "link.jsonl", "real.jsonl"]


def test_the_report_hint_is_a_command_the_shell_runs_as_printed(disk_dir):
    # The last line tells how to plot the metrics: a path with a space, quoted, so that the
    # hint pasted into a shell names the file.
    import shlex

    metrics = os.path.join(disk_dir, "my runs", "m.jsonl")
    os.makedirs(os.path.dirname(metrics))
    out = train([*SMALL[2:], "--iterations", "1", "--metrics", metrics]).stdout
    hint = out.split("(plot with: ")[1].split(")\n")[0]
    assert shlex.split(hint) == ["greenroom", "report", metrics]
