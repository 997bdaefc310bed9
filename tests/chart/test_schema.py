"""values.schema.json refuses bad values before anything renders, with a message that
names the value and says why (real helm binary, `helm template`)."""

import warnings

import pytest

from tests.chart.support import CHART, helm, reject

pytestmark = pytest.mark.helm


def test_memory_backed_emptydir_is_refused_saying_why():
    err = reject("storage.mode=emptyDir", "storage.emptyDir.medium=Memory")
    assert "storage.emptyDir.medium Memory is refused: a Memory (tmpfs) emptyDir" in err
    assert "defeats offloading" in err
    # The fix names a key that exists.
    assert "or use storage.mode hostPath" in err and "storage.type" not in err


# Every refusal that compares values, with the words its one line must hold.
CROSS_VALUE_REFUSALS = [
    (("storage.mode=pvc",), "storage.pvc.claimName is needed with storage.mode pvc"),
    (("storage.mode=emptyDir", "storage.emptyDir.medium=Memory"), "storage.emptyDir.medium Memory is refused"),
    (
        ("offload.train=true", "offload.target=cpu", "streamOptimizerState.toDisk=true"),
        "streamOptimizerState.toDisk with offload.train needs offload.target disk",
    ),
    (("offload.target=disk",), "offload.target disk requires offload.train"),
    (("offload.diskCompression=zstd", "offload.diskChunkMb=2"), "offload.diskCompression nvcomp-ans or zstd needs"),
    (("streamOptimizerState.hostCacheGb=8",), "streamOptimizerState.hostCacheGb needs streamOptimizerState.toDisk"),
    (("streamOptimizerState.masterLayout=fp32",), "streamOptimizerState.masterLayout fp32 needs"),
    (("args={--x}",), "args are the arguments of command and need it"),
    (("command={python,t.py}", "train.save=/ck"), "configure greenroom train, which command replaces"),
    (("torchrun.enabled=false", "torchrun.extraArgs={--x}"), "torchrun.extraArgs are arguments of torchrun"),
    (("podLabels.helm\\.sh/chart=x",), "podLabels: helm.sh/chart is a label the chart sets"),
]


@pytest.mark.parametrize("sets, words", CROSS_VALUE_REFUSALS, ids=[s[0][0] for s in CROSS_VALUE_REFUSALS])
def test_a_refusal_that_compares_values_reads_as_one_line(sets, words):
    err = reject(*sets)
    (line,) = [line for line in err.splitlines() if line.startswith("Error:")]
    assert line.startswith("Error: execution error at (greenroom/templates/") and words in line, err
    # Not a schema rule's frame around the message.
    assert "allOf" not in err and "missing property" not in err, err


def test_unknown_values_are_refused():
    err = reject("offload.targte=disk")
    assert "at '/offload': additional properties 'targte' not allowed" in err
    err = reject("replicas=3")
    assert "additional properties 'replicas' not allowed" in err


def test_negative_chunk_is_refused():
    err = reject("offload.diskChunkMb=-1")
    assert "/offload/diskChunkMb" in err and "minimum" in err


@pytest.mark.parametrize(
    "value, where",
    [
        ("offload.target=nvme", "/offload/target"),
        ("streamOptimizerState.momentDtype=fp4", "/streamOptimizerState/momentDtype"),
        ("streamOptimizerState.hostCacheGb=-1", "/streamOptimizerState/hostCacheGb"),
        ("storage.hostPath.type=File", "/storage/hostPath/type"),
        ("nodes=0", "/nodes"),
        ("workload=deployment", "/workload"),
        ("train.role=a/b", "/train/role"),
    ],
)
def test_out_of_range_values_name_their_key(value, where):
    assert f"at '{where}'" in reject(value)


@pytest.mark.parametrize(
    "sets, message",
    [
        # Refused the way `greenroom slurm` refuses tasks_per_node > gpus_per_node.
        (("procsPerNode=8", "gpu.count=1"), "procsPerNode 8 > gpu.count 1: each process needs its own GPU"),
        (
            ("torchrun.enabled=false", "nodes=2", "procsPerNode=4", "gpu.count=4"),
            "procsPerNode 4 needs torchrun.enabled: without a launcher each pod runs one process",
        ),
        (("storage.mode=pvc",), "storage.pvc.claimName is needed with storage.mode pvc"),
        (("hugepages.size=2Mi", "hugepages.amount=1Gi"), "hugepages need a cpu or memory request"),
        (("hugepages.size=2Mi",), "hugepages.size needs hugepages.amount"),
        # The default podSecurityContext says runAsNonRoot: the kubelet would never start a root trainer.
        (("podSecurityContext.runAsUser=0",), "runAsUser 0 (root) with runAsNonRoot true: the kubelet would never"),
        (("securityContext.runAsUser=0",), "set podSecurityContext.runAsNonRoot=false beside runAsUser 0"),
    ],
)
def test_what_compares_two_values_is_refused_naming_them(sets, message):
    # helm frames the message with its own lines; the message itself is one line.
    assert any(message in line for line in reject(*sets).splitlines())


@pytest.mark.parametrize(
    "value, where",
    [
        ("storage.mode=hostpath", "/storage/mode"),
        ("greenroomArgs=always", "/greenroomArgs"),
        ("train.resume=maybe", "/train/resume"),
        ("job.podFailurePolicy.failExitCodes={0}", "/job/podFailurePolicy/failExitCodes/0"),
        ("schedulerNam=volcano", ""),
    ],
)
def test_new_values_are_checked_too(value, where):
    err = reject(value)
    assert (f"at '{where}'" in err) if where else "additional properties 'schedulerNam' not allowed" in err


def test_streaming_under_cpu_offload_is_refused_like_greenroom_train_does():
    err = reject("offload.train=true", "offload.target=cpu", "streamOptimizerState.toDisk=true")
    assert "streamOptimizerState.toDisk with offload.train needs offload.target disk" in err


def test_host_cache_without_streaming_is_refused_like_greenroom_train_does():
    err = reject("streamOptimizerState.hostCacheGb=8")
    assert "streamOptimizerState.hostCacheGb needs streamOptimizerState.toDisk" in err


def test_whole_masters_without_streaming_are_refused_like_greenroom_train_does():
    err = reject("streamOptimizerState.masterLayout=fp32")
    assert "streamOptimizerState.masterLayout fp32 needs streamOptimizerState.toDisk" in err
    assert "/streamOptimizerState/masterLayout" in reject("streamOptimizerState.masterLayout=fp16")


def _cli_refuses(**flags) -> bool:
    """Whether greenroom train's own config check (OffloadFlags) refuses these flags."""
    from greenroom.config import OffloadFlags
    from greenroom.errors import ConfigError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a target given without --offload-train is only warned of
            OffloadFlags(**flags)
    except ConfigError:
        return True
    return False


def _chart_refuses(*sets: str) -> str | None:
    out = helm("template", "rel", CHART, *[a for s in sets for a in ("--set", s)])
    return out.stderr if out.returncode else None


@pytest.mark.parametrize("compression", ["auto", "none", "nvcomp-ans", "zstd"])
@pytest.mark.parametrize("below", [3, 1, 0, -1])
def test_a_chunk_too_small_for_the_codec_is_refused_exactly_where_greenroom_train_refuses_it(compression, below):
    # Refused at install: rendered, every trainer would exit 2 at start.
    from greenroom.io.codec_names import MIN_COMPRESSED_CHUNK_MB

    chunk = MIN_COMPRESSED_CHUNK_MB - below
    err = _chart_refuses(f"offload.diskCompression={compression}", f"offload.diskChunkMb={chunk}")
    assert (err is not None) == _cli_refuses(
        offload_train_disk_compression=compression, offload_train_disk_chunk_mb=chunk
    ), err
    if err:
        assert (
            f"offload.diskCompression nvcomp-ans or zstd needs offload.diskChunkMb {MIN_COMPRESSED_CHUNK_MB} or more"
        ) in err


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_offload_target_is_refused_exactly_where_greenroom_train_refuses_it(train, target, stream):
    # Refused at install: rendered, the target's flag would be silently left out.
    err = _chart_refuses(
        f"offload.train={str(train).lower()}",
        f"offload.target={target}",
        f"streamOptimizerState.toDisk={str(stream).lower()}",
    )
    assert (err is not None) == _cli_refuses(
        offload_train=train, offload_train_target=target, stream_optimizer_state_to_disk=stream
    ), err
    if target == "disk" and not train:
        assert "offload.target disk requires offload.train: set offload.train true" in err
    # A train key dropped with null is no --offload-train either: refused as every null is.
    if target == "disk" and train:
        assert "at '/offload': missing property 'train'" in _chart_refuses("offload.train=null", "offload.target=disk")


def test_args_without_a_command_are_refused_not_left_out():
    # Refused at install: `args` without `command` would render nowhere (greenroom train would run without them).
    err = reject("args={--output-dir,/ckpt}")
    assert "args are the arguments of command and need it" in err and "train.extraArgs" in err
    assert "missing property 'command'" in reject("args={--x}", "command=null")  # as every null is
    assert _chart_refuses("command={python,t.py}", "args={--x}") is None
    assert _chart_refuses("train.extraArgs={--no-progress}") is None


def test_torchrun_args_without_torchrun_are_refused_not_left_out():
    # Refused at install: torchrun.extraArgs would render nowhere with torchrun.enabled=false.
    err = reject("torchrun.enabled=false", "torchrun.extraArgs={--max-restarts=3}")
    assert "torchrun.extraArgs are arguments of torchrun and need torchrun.enabled true" in err
    assert _chart_refuses("torchrun.extraArgs={--max-restarts=3}") is None
    assert _chart_refuses("torchrun.enabled=false") is None


@pytest.mark.parametrize(
    "value", ["train.iterations=3", "train.save=/ckpt", "train.load=/ckpt", "train.extraArgs={--no-progress}"]
)
def test_greenroom_train_values_beside_a_command_are_refused_not_left_out(value):
    err = reject("command={python,t.py}", value)
    assert "configure greenroom train, which command replaces" in err


@pytest.mark.parametrize("key", ["podLabels", "jobLabels"])
@pytest.mark.parametrize("label", ["app.kubernetes.io/name", "app.kubernetes.io/component", "helm.sh/chart"])
def test_labels_that_clash_with_the_charts_own_are_refused_naming_the_key(key, label):
    # Refused at install: rendered, a second key's value would win on the pods, and the
    # rendezvous Service and onePodPerNode's anti-affinity would not select them.
    err = reject(f"{key}.{label.replace('.', chr(92) + '.')}=mine")
    assert f"{key}: {label} is a label the chart sets (helm.sh/chart, app.kubernetes.io/name" in err
    assert _chart_refuses(f"{key}.team=rl", f"{key}.kueue\\.x-k8s\\.io/queue-name=a") is None
