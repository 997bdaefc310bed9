"""Two nodes: a multi-pod JobSet of the chart with `onePodPerNode` (its default) spreads over
the test cluster's two kubelets and trains as one gloo group across them.

Both nodes run on this machine (scripts/k8s/node2.sh): the second has its own containerd,
kubelet, bridge and pod subnet, and the taint greenroom.dev/second-node:NoSchedule, because
a hostPath there is the same directory as on the first node. So this job tolerates the
taint and keeps its offload files in an emptyDir, which is each pod's own on any node.
"""

import pytest

from tests.k8s.support import (
    cluster_fixture,
    install,
    kubectl,
    kubectl_json,
    namespace,
    pods,
    trainer_values,
    wait_until,
)
from tests.k8s.test_pods import image_values

pytestmark = pytest.mark.k8s
__all__ = ["namespace"]  # the fixture, imported for the test below
cluster = cluster_fixture("node", "image", "pods", "node2", "dns", "jobset")

SECOND_NODE_TAINT = {"key": "greenroom.dev/second-node", "operator": "Exists", "effect": "NoSchedule"}


def jobset_state(ns: str, name: str) -> str | None:
    conditions = kubectl_json("-n", ns, "get", "jobset", name).get("status", {}).get("conditions", [])
    done = [c["type"] for c in conditions if c["type"] in ("Completed", "Failed") and c["status"] == "True"]
    return done[0] if done else None


def test_a_two_pod_jobset_spreads_over_both_nodes_and_trains_across_them(namespace):
    ns = namespace("privileged")
    values = trainer_values(
        2,
        "emptyDir",
        **image_values(),
        workload="jobset",
        onePodPerNode=True,
        tolerations=[SECOND_NODE_TAINT],
        train={"iterations": 2, "extraArgs": ["--no-progress"]},
        offload={"train": True, "target": "disk", "diskChunkMb": 4, "diskCompression": "none"},
        streamOptimizerState={"toDisk": True},
    )
    install("spread", ns, values)
    (jobset,) = kubectl_json("-n", ns, "get", "jobsets")["items"]
    name = jobset["metadata"]["name"]
    selector = f"jobset.sigs.k8s.io/jobset-name={name}"

    def trainer_logs() -> str:
        return kubectl("-n", ns, "logs", "-l", selector, "-c", "trainer", "--tail=-1", "--prefix", check=False).stdout

    try:  # well inside the test's own timeout, so a stuck job says where each pod got to
        state = wait_until("the 2-pod JobSet finished", lambda: jobset_state(ns, name), timeout=300, ns=ns)
    except AssertionError as e:
        where = [
            (
                p["metadata"]["name"],
                p["spec"].get("nodeName"),
                p["status"].get("phase"),
                [c.get("state") for c in p["status"].get("containerStatuses", [])],
            )
            for p in pods(ns, selector)
        ]
        raise AssertionError(f"{e}; pods: {where}; trainer logs:\n{trainer_logs()}") from None
    out = trainer_logs()
    assert state == "Completed", out
    # One pod on each node (the chart's required anti-affinity), one gloo group of both.
    assert sorted(p["spec"]["nodeName"] for p in pods(ns, selector)) == ["greenroom-node", "greenroom-node2"]
    # Rank 0 prints the run's header; rank 1, in the other pod, ran in the same group.
    headers = [line for line in out.splitlines() if "greenroom train:" in line]
    assert headers and all("2 rank(s)" in h and "offload disk" in h for h in headers), out
    assert "greenroom[rank 1]" in out, out
