"""The local Kubernetes cluster (scripts/services.d/k8s.sh) for the chart tests: its status,
kubectl and helm against it, namespaces at a Pod Security level, and the chart's values.

`make test` starts the cluster (scripts/with-services.sh); by hand: `make cluster`. What
could not start is in .run/k8s/status as `part: reason`, and the tests needing that part
skip with the reason.
"""

import json
import os
import subprocess
import tempfile
import time
import uuid

import pytest
import yaml

from tests.conftest import REPO, require_tool

CLUSTER_DIR = os.environ.get("GREENROOM_K8S_DIR", os.path.join(REPO, ".run", "k8s"))
KUBECONFIG = os.path.join(CLUSTER_DIR, "admin.kubeconfig")
CHARTS = os.path.join(REPO, "deploy", "helm")
CHART = os.path.join(CHARTS, "greenroom")
JANITOR_CHART = os.path.join(CHARTS, "greenroom-janitor")
# Generous bounds for a shared 2-core machine: a wait that runs out is a failure to reach
# the state, never a speed check.
WAIT_S = 300


def cluster_status() -> dict[str, str]:
    try:
        with open(os.path.join(CLUSTER_DIR, "status")) as f:
            return dict(line.rstrip("\n").split(": ", 1) for line in f if ": " in line)
    except FileNotFoundError:
        return {}


def require_cluster(part: str = "control-plane") -> None:
    """Skip unless `part` of the cluster (control-plane, node, image, pods, node2, dns,
    jobset: scripts/services.d/k8s.sh writes their status) is up, with its reason."""
    require_tool("helm")
    require_tool("kubectl")
    status = cluster_status()
    if not status:
        pytest.skip(
            f"no Kubernetes test cluster ({CLUSTER_DIR}/status missing): "
            "`make test` or `make cluster` starts it (scripts/services.d/k8s.sh)"
        )
    if "control-plane" != part and not status.get("control-plane", "").startswith("up"):
        part = "control-plane"
    reason = status.get(part, "not started")
    if not reason.startswith("up"):
        pytest.skip(f"the test cluster's {part} is not up: {reason}")


def cluster_fixture(*parts: str):
    """A test module's autouse fixture (``cluster = cluster_fixture("node")``): each of its
    tests skips, saying why, unless these parts of the cluster are up (default: the
    control plane)."""

    @pytest.fixture(autouse=True)
    def cluster():
        for part in parts or ("control-plane",):
            require_cluster(part)

    return cluster


def kubectl(
    *argv: str, check: bool = True, user: str | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    cmd = ["kubectl", "--kubeconfig", KUBECONFIG, *argv]
    if user:
        cmd[3:3] = ["--as", user]
    out = subprocess.run(cmd, capture_output=True, text=True, input=stdin)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out


def kubectl_json(*argv: str) -> dict:
    return json.loads(kubectl(*argv, "-o", "json").stdout)


def helm(*argv: str, check: bool = True, user: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["helm", "--kubeconfig", KUBECONFIG, *argv]
    if user:
        cmd += ["--kube-as-user", user]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return out


def values_file(values: dict) -> str:
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False, dir=os.environ.get("TMPDIR"))
    with f:
        yaml.safe_dump(values, f)
    return f.name


def install(
    release: str, namespace: str, values: dict, chart: str = CHART, action: str = "install", **kw
) -> subprocess.CompletedProcess:
    path = values_file(values)
    try:
        return helm(action, release, chart, "--namespace", namespace, "-f", path, **kw)
    finally:
        os.unlink(path)


def warning_events(ns: str, last: int = 5) -> str:
    """The newest Warning events of `ns`, one per line: why a pod is stuck (a sandbox its
    network plugin could not set up, a volume that did not mount), which its logs never say."""
    out = kubectl("-n", ns, "get", "events", "--field-selector", "type=Warning", "-o", "json", check=False)
    if out.returncode != 0:
        return f"(its events could not be read: {out.stderr.strip()})"
    items = sorted(json.loads(out.stdout)["items"], key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    lines = [
        f"{e['involvedObject'].get('name')}: {e.get('reason')}: {e.get('message', '').strip()}" for e in items[-last:]
    ]
    return "\n".join(lines) or "(no Warning event)"


def wait_until(what: str, probe, timeout: float = WAIT_S, ns: str | None = None):
    """Poll `probe` until it returns something truthy; fail naming `what` if it never does,
    with the newest Warning events of namespace `ns` where one is given."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            why = f"; the newest Warning events of {ns}:\n{warning_events(ns)}" if ns else ""
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s{why}")
        time.sleep(1)


@pytest.fixture
def namespace():
    """Makes namespaces at a Pod Security level (`enforce` and `warn` labels); deletes them after."""
    made = []

    def make(level: str) -> str:
        name = f"gr-{level[:4]}-{uuid.uuid4().hex[:6]}"
        kubectl("create", "namespace", name)
        kubectl(
            "label",
            "namespace",
            name,
            f"pod-security.kubernetes.io/enforce={level}",
            f"pod-security.kubernetes.io/warn={level}",
        )
        made.append(name)
        return name

    yield make
    for name in made:
        # Releases first: their cluster-scoped objects (the janitor's ClusterRole) would
        # outlive the namespace.
        for release in helm("-n", name, "list", "-q", check=False).stdout.split():
            helm("-n", name, "uninstall", release, check=False)
        kubectl("delete", "namespace", name, "--wait=false", check=False)


def chart_values() -> dict:
    """The chart's defaults (to tell which storage keys this version of the chart has)."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        return yaml.safe_load(f)


def storage_values(mode: str, node_root: str = "/mnt/nvme/greenroom") -> dict:
    """`storage` values for a mode: hostPath, emptyDir, ephemeral or pvc."""
    storage = chart_values()["storage"]
    key = "mode" if "mode" in storage else "type"
    if mode not in ("hostPath", "emptyDir") and key == "type":
        pytest.skip(f"this chart has no storage mode {mode!r} (storage.type is hostPath or emptyDir)")
    values: dict = {key: mode}
    if mode == "hostPath":
        values["hostPath"] = {"path": node_root, "type": "DirectoryOrCreate"}
    if mode == "ephemeral":
        values["ephemeral"] = {"storageClassName": "greenroom-local", "size": "1Gi"}
    if mode == "pvc":
        values["pvc"] = {"claimName": "greenroom-offload"}
    return {"storage": values}


def trainer_values(nodes: int, mode: str = "hostPath", **extra) -> dict:
    """A CPU trainer job of `nodes` pods on the one test node."""
    values: dict = {
        "nodes": nodes,
        "gpu": {"count": 0},
        "shmSizeLimit": "256Mi",
        "image": {"repository": "localhost/greenroom", "tag": "k8s-test", "pullPolicy": "Never"},
        **storage_values(mode),
    }
    if "onePodPerNode" in chart_values():
        values["onePodPerNode"] = False  # one node: every rank shares it
    values.update(extra)
    return values


def pods(namespace: str, selector: str) -> list[dict]:
    return kubectl_json("-n", namespace, "get", "pods", "-l", selector)["items"]


def events(namespace: str, reason: str | None = None) -> list[dict]:
    items = kubectl_json("-n", namespace, "get", "events")["items"]
    return [e for e in items if reason is None or e.get("reason") == reason]


def janitor_values(root: str, image: dict | None = None) -> dict:
    """The janitor on `root`: its own chart's values where there is one, else the trainer
    chart's `janitor` (whose trainer then only sleeps: a live pod on the node)."""
    image = image or {"repository": "localhost/greenroom", "tag": "k8s-test", "pullPolicy": "Never"}
    if os.path.isdir(JANITOR_CHART):
        return {"image": image, "root": root, "rootType": "Directory", "intervalSeconds": 2}
    # Without the init container: it would reclaim the root by the lock rule first.
    values = trainer_values(
        1,
        "hostPath",
        image=image,
        command=["sleep", "3600"],
        torchrun={"enabled": False},
        janitor={"enabled": True, "intervalSeconds": 2},
        reclaim={"initContainer": {"enabled": False}},
    )
    values["storage"]["hostPath"]["path"] = root
    return values


def janitor_install(release: str, ns: str, values: dict | None = None, **kw) -> subprocess.CompletedProcess:
    chart = JANITOR_CHART if os.path.isdir(JANITOR_CHART) else CHART
    return install(release, ns, values or janitor_values("/mnt/nvme/greenroom"), chart=chart, **kw)
