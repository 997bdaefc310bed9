"""The chart's pods, run for real: a kubelet with containerd and runc on this machine (the
local cluster's node, scripts/k8s/node.sh), the image `make image` builds from
images/Dockerfile, on the CI base with PyPI's CUDA torch (scripts/k8s/image.sh), CoreDNS
resolving the headless Service for the rendezvous.

The node's offload root is a dir of this checkout (the node is this machine), so the test
plants and inspects per-rank dirs there directly, with real lock holders
(tests/rank_holder.py) for live and dead ranks.
"""

import os
import shutil
import signal
import subprocess
import uuid

import pytest
import torch

from greenroom.dirs.names import MADE_NAME
from tests.conftest import REPO
from tests.k8s.support import (
    CLUSTER_DIR,
    cluster_fixture,
    helm,
    install,
    janitor_install,
    janitor_values,
    kubectl,
    kubectl_json,
    namespace,
    pods,
    require_cluster,
    trainer_values,
    wait_until,
)

pytestmark = pytest.mark.k8s
__all__ = ["namespace"]  # the fixture, imported for the tests below
cluster = cluster_fixture("node", "image", "pods")

TRAINER_UID = 1000


@pytest.fixture
def node_root():
    """The offload root the chart mounts from the node (this machine), owned by the test."""
    path = os.path.join(REPO, ".run", "k8s-node", uuid.uuid4().hex[:12])
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def image_values() -> dict:
    """The image the cluster imported: images/Dockerfile built on the CI base (scripts/k8s/image.sh)."""
    with open(os.path.join(CLUSTER_DIR, "image")) as f:
        repository, tag = f.read().strip().rsplit(":", 1)
    return {"image": {"repository": repository, "tag": tag, "pullPolicy": "Never"}}


TORCH_POD = """
apiVersion: v1
kind: Pod
metadata: {name: torch-import}
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  containers:
  - name: python
    image: %s
    imagePullPolicy: Never
    command: [python3, -c, "import torch; print(torch.__version__, torch.cuda.is_available())"]
"""


def test_the_images_own_cuda_torch_imports_on_the_cpu_node(namespace):
    # The image's torch is PyPI's CUDA build with its nvidia-* runtime wheels, nothing of
    # the node's mounted: it imports, and finds no GPU here.
    ns = namespace("privileged")
    image = image_values()["image"]
    kubectl("-n", ns, "apply", "-f", "-", stdin=TORCH_POD % f"{image['repository']}:{image['tag']}")

    def finished() -> str | None:
        phase = kubectl_json("-n", ns, "get", "pod", "torch-import")["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_until("the pod finished", finished, ns=ns)
    out = kubectl("-n", ns, "logs", "torch-import", check=False)
    assert phase == "Succeeded", out.stdout + out.stderr
    assert out.stdout.strip() == f"{torch.__version__} False"


def train_values(node_root: str, nodes: int = 2, iterations: int = 2) -> dict:
    """`greenroom train` with disk offload and optimizer-state streaming, small and on the CPU."""
    values = trainer_values(
        nodes,
        "hostPath",
        **image_values(),
        train={"iterations": iterations, "extraArgs": ["--no-progress"]},
        offload={"train": True, "target": "disk", "diskChunkMb": 4, "diskCompression": "none"},
        streamOptimizerState={"toDisk": True},
    )
    values["storage"]["hostPath"]["path"] = node_root
    return values


def job_state(ns: str, name: str) -> str | None:
    conditions = kubectl_json("-n", ns, "get", "job", name).get("status", {}).get("conditions", [])
    done = [c["type"] for c in conditions if c["type"] in ("Complete", "Failed") and c["status"] == "True"]
    return done[0] if done else None


def logs(ns: str, selector: str, container: str = "trainer") -> str:
    return kubectl("-n", ns, "logs", "-l", selector, "-c", container, "--tail=-1", "--prefix", check=False).stdout


def files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def test_two_pods_train_with_disk_offload_and_streaming_over_gloo(namespace, node_root):
    require_cluster("dns")  # the rendezvous resolves pod 0's name
    ns = namespace("privileged")
    install("dp2", ns, train_values(node_root))
    job = "dp2-greenroom"
    state = wait_until("the 2-pod Indexed Job finished", lambda: job_state(ns, job), timeout=900, ns=ns)
    out = logs(ns, "app.kubernetes.io/instance=dp2")
    assert state == "Complete", out
    # Both ranks, in their own pods, joined one gloo group through pod 0's DNS name.
    headers = [line for line in out.splitlines() if "greenroom train:" in line]
    assert headers and all("2 rank(s)" in h and "offload disk" in h and "streaming on" in h for h in headers), out
    assert {p["spec"]["nodeName"] for p in pods(ns, "app.kubernetes.io/instance=dp2")} == {"greenroom-node"}

    # helm uninstall leaves no file on the node path but the init containers' markers of the
    # empty pod dirs they made (Note [made parents] of greenroom.dirs.tree), which the janitor
    # removes: the ranks removed their own.
    helm("-n", ns, "uninstall", "dp2", "--wait")
    wait_until("the trainer pods gone", lambda: not pods(ns, "app.kubernetes.io/instance=dp2"), ns=ns)
    left = files_under(node_root)
    assert all(os.path.basename(f) == MADE_NAME for f in left), left


def test_init_container_reclaims_a_dead_rank_and_keeps_a_live_one(namespace, node_root, holders):
    planted = os.path.join(node_root, "planted-pod-uid")
    live_proc, live = holders(planted, "job-live")
    dead_proc, dead = holders(planted, "job-dead")
    dead_proc.send_signal(signal.SIGKILL)
    dead_proc.wait()
    ns = namespace("privileged")
    install("ic", ns, train_values(node_root, nodes=1, iterations=1))
    wait_until(
        "the init container ran",
        lambda: "greenroom-init:" in logs(ns, "app.kubernetes.io/instance=ic", container="prepare-offload-dir"),
        ns=ns,
    )
    assert not os.path.exists(dead)
    assert os.path.isdir(live) and live_proc.poll() is None


LIVE_POD = """
apiVersion: v1
kind: Pod
metadata: {name: live, labels: {greenroom-test: live}}
spec:
  automountServiceAccountToken: false
  securityContext: {runAsNonRoot: true, runAsUser: 1000, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: sleep
    image: localhost/greenroom-pause:1
    imagePullPolicy: Never
    securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
"""


def killed(start, root: str, job: str, pod_uid: str) -> str:
    """A rank dir of pod `pod_uid` whose process was SIGKILLed: its lock is free."""
    p, path = start(root, job, pod_uid=pod_uid)
    p.send_signal(signal.SIGKILL)
    p.wait()
    return path


def test_janitor_reclaims_a_gone_pods_dir_through_the_api_and_keeps_a_live_pods(namespace, node_root, holders):
    ns = namespace("privileged")
    kubectl("-n", ns, "apply", "-f", "-", stdin=LIVE_POD)
    wait_until(
        "the live pod running",
        lambda: kubectl_json("-n", ns, "get", "pod", "live")["status"].get("phase") == "Running",
        ns=ns,
    )
    live_uid = kubectl_json("-n", ns, "get", "pod", "live")["metadata"]["uid"]
    # Both owners are dead processes: only the API can tell the pod that is still there.
    kept = killed(holders, os.path.join(node_root, live_uid), "job-a", live_uid)
    gone_uid = str(uuid.uuid4())
    removed = killed(holders, os.path.join(node_root, gone_uid), "job-b", gone_uid)
    janitor_install("jan-pods", ns, janitor_values(node_root, image=image_values()["image"]))
    wait_until("the janitor removed the gone pod's rank dir", lambda: not os.path.exists(removed), ns=ns)
    assert os.path.isdir(kept)

    def reclaim_events() -> list[dict]:
        return [
            e
            for e in kubectl_json("-n", "default", "get", "events")["items"]
            if e.get("reason") == "StaleOffloadReclaimed" and gone_uid in e.get("message", "")
        ]

    (event, *_) = wait_until("the janitor's Event about it", reclaim_events, ns=ns)
    assert event["involvedObject"]["kind"] == "Node"

    # Scraped from the node, as Prometheus would: the pod's address on the bridge, the
    # charts' default metrics port.
    (janitor,) = pods(ns, "app.kubernetes.io/component=janitor")
    metrics = subprocess.run(
        ["curl", "-fsS", f"http://{janitor['status']['podIP']}:9400/metrics"], capture_output=True, text=True
    )
    assert metrics.returncode == 0, metrics.stderr
    assert "greenroom_reclaim_dirs_total 1.0" in metrics.stdout, metrics.stdout


def model_state(ckpt: str) -> dict:
    from greenroom.train import rotation

    return torch.load(os.path.join(rotation.candidates(ckpt)[0], "rank00000", "model.pt"), weights_only=True)


def test_a_deleted_trainer_saves_on_sigterm_runs_again_and_resumes_bit_identically(namespace, node_root):
    ckpt = node_root + "-ckpt"
    os.makedirs(ckpt)
    os.chown(ckpt, TRAINER_UID, TRAINER_UID)
    try:
        ns = namespace("privileged")

        def values(name: str) -> dict:
            v = train_values(node_root, nodes=1, iterations=12)
            v["train"].update(save=f"/ckpt/{name}", load=f"/ckpt/{name}")
            v["extraVolumes"] = [{"name": "ckpt", "hostPath": {"path": ckpt, "type": "Directory"}}]
            v["extraVolumeMounts"] = [{"name": "ckpt", "mountPath": "/ckpt"}]
            return v

        install("whole", ns, values("whole"))
        install("cut", ns, values("cut"))
        selector = "app.kubernetes.io/instance=cut"
        wait_until("the trainer past its first iteration", lambda: "iter   1/12" in logs(ns, selector), ns=ns)
        (first,) = pods(ns, selector)
        # preStop, then SIGTERM: the trainer saves and exits 143, which the Job's pod
        # failure policy counts and runs again; the new pod resumes with --resume auto.
        kubectl("-n", ns, "delete", "pod", first["metadata"]["name"], "--wait=false")
        for release in ("whole", "cut"):
            state = wait_until(f"{release} finished", lambda: job_state(ns, f"{release}-greenroom"), timeout=900, ns=ns)
            assert state == "Complete", logs(ns, f"app.kubernetes.io/instance={release}")
        # The pod that finished is a new one, and it resumed from the save on SIGTERM.
        (second,) = pods(ns, selector)
        assert second["metadata"]["uid"] != first["metadata"]["uid"]
        assert "resuming at iteration" in logs(ns, selector)
        whole, cut = model_state(os.path.join(ckpt, "whole")), model_state(os.path.join(ckpt, "cut"))
        assert whole.keys() == cut.keys()
        for key in whole:
            assert torch.equal(whole[key], cut[key]), key
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
