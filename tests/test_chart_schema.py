"""values.schema.json refuses bad values before anything renders, with a message that
names the value and says why (real helm binary, `helm template`)."""

import pytest

from tests.chart_support import reject

pytestmark = pytest.mark.helm


def test_memory_backed_emptydir_is_refused_saying_why():
    err = reject("storage.type=emptyDir", "storage.emptyDir.medium=Memory")
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


def test_janitor_with_emptydir_is_refused_saying_why():
    err = reject("janitor.enabled=true", "storage.type=emptyDir")
    assert "janitor.enabled needs storage.type hostPath" in err


def test_streaming_under_cpu_offload_is_refused_like_greenroom_train_does():
    err = reject("offload.target=cpu", "streamOptimizerState.toDisk=true")
    assert "streamOptimizerState.toDisk with offload.train needs offload.target disk" in err


def test_host_cache_without_streaming_is_refused_like_greenroom_train_does():
    err = reject("streamOptimizerState.hostCacheGb=8")
    assert "streamOptimizerState.hostCacheGb needs streamOptimizerState.toDisk" in err
