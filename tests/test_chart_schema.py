"""values.schema.json refuses bad values before anything renders, with a message that
names the value and says why (real helm binary, `helm template`)."""

import pytest

from tests.chart_support import reject

pytestmark = pytest.mark.helm


def test_memory_backed_emptydir_is_refused_saying_why():
    err = reject("storage.mode=emptyDir", "storage.emptyDir.medium=Memory")
    assert "/storage/emptyDir" in err
    assert "storage.emptyDir.medium Memory (tmpfs) is refused" in err
    assert "defeats offloading" in err


def test_unknown_values_are_refused():
    err = reject("offload.targte=disk")
    assert "at '/offload': additional properties 'targte' not allowed" in err
    err = reject("replicas=3")
    assert "additional properties 'replicas' not allowed" in err


def test_negative_chunk_is_refused():
    err = reject("offload.diskChunkMb=-1")
    assert "/offload/diskChunkMb" in err and "minimum" in err


@pytest.mark.parametrize("value, where", [
    ("offload.target=nvme", "/offload/target"),
    ("streamOptimizerState.momentDtype=fp4", "/streamOptimizerState/momentDtype"),
    ("streamOptimizerState.hostCacheGb=-1", "/streamOptimizerState/hostCacheGb"),
    ("storage.hostPath.type=File", "/storage/hostPath/type"),
    ("nodes=0", "/nodes"),
    ("workload=deployment", "/workload"),
    ("train.role=a/b", "/train/role"),
])
def test_out_of_range_values_name_their_key(value, where):
    assert f"at '{where}'" in reject(value)


@pytest.mark.parametrize("sets, message", [
    # Refused the way `greenroom slurm` refuses tasks_per_node > gpus_per_node.
    (("procsPerNode=8", "gpu.count=1"), "procsPerNode 8 > gpu.count 1: each process needs its own GPU"),
    (("torchrun.enabled=false", "nodes=2", "procsPerNode=4", "gpu.count=4"),
     "procsPerNode 4 needs torchrun.enabled: without a launcher each pod runs one process"),
    (("storage.mode=pvc",), "storage.pvc.claimName is needed with storage.mode pvc"),
    (("hugepages.size=2Mi", "hugepages.amount=1Gi"), "hugepages need a cpu or memory request"),
    (("hugepages.size=2Mi",), "hugepages.size needs hugepages.amount"),
    # The default podSecurityContext says runAsNonRoot: the kubelet would never start a root trainer.
    (("podSecurityContext.runAsUser=0",), "runAsUser 0 (root) with runAsNonRoot true: the kubelet would never"),
    (("securityContext.runAsUser=0",), "set podSecurityContext.runAsNonRoot=false beside runAsUser 0"),
])
def test_what_compares_two_values_is_refused_naming_them(sets, message):
    # helm frames the message with its own lines; the message itself is one line.
    assert any(message in line for line in reject(*sets).splitlines())


@pytest.mark.parametrize("value, where", [
    ("storage.mode=hostpath", "/storage/mode"),
    ("greenroomArgs=always", "/greenroomArgs"),
    ("train.resume=maybe", "/train/resume"),
    ("job.podFailurePolicy.failExitCodes={0}", "/job/podFailurePolicy/failExitCodes/0"),
    ("schedulerNam=volcano", ""),
])
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
