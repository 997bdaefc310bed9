"""The chart against a real API server (the local cluster of scripts/services.d/k8s.sh):
Pod Security admission per storage mode, the janitor's RBAC and Pod Security check, the
JobSet controller, and `helm upgrade`/`helm uninstall` leaving nothing behind.

These need the control plane only: the Job and JobSet controllers create the pods (or are
refused), the scheduler need not place them. What runs in the pods is tests/k8s/test_pods.py.
"""

import json
import os

import pytest

from tests.k8s.support import (
    CHART,
    cluster_fixture,
    events,
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
    values_file,
    wait_until,
)

pytestmark = pytest.mark.k8s
__all__ = ["namespace"]  # the fixture, imported for the tests below
cluster = cluster_fixture()

TRAINERS = "app.kubernetes.io/component=trainer"


def trainer_pods(ns: str, release: str) -> list[dict]:
    return pods(ns, f"app.kubernetes.io/instance={release},{TRAINERS}")


def refusals(ns: str) -> list[str]:
    return [e["message"] for e in events(ns, "FailedCreate")]


def test_hostpath_is_admitted_when_privileged_and_refused_under_baseline(namespace):
    values = trainer_values(2, "hostPath")
    privileged = namespace("privileged")
    install("hp", privileged, values)
    wait_until(
        "both hostPath trainer pods created in a privileged namespace",
        lambda: len(trainer_pods(privileged, "hp")) == 2,
        ns=privileged,
    )
    assert refusals(privileged) == []

    baseline = namespace("baseline")
    # The chart reads the namespace's level from the API (lookup) and refuses in one line.
    refused = install("hp", baseline, values, check=False)
    assert refused.returncode != 0
    assert (
        f'namespace {baseline} enforces Pod Security "baseline", and these values need "privileged"' in refused.stderr
    ), refused.stderr
    assert "storage.mode hostPath" in refused.stderr
    # The API server refuses the same pods by itself: the manifests applied without helm
    # (a template render does no lookup) give a Job whose pods are never created.
    path = values_file(values)
    try:
        rendered = helm("template", "hp", CHART, "--namespace", baseline, "-f", path).stdout
    finally:
        os.unlink(path)
    out = kubectl("-n", baseline, "apply", "-f", "-", stdin=rendered)
    assert "would violate PodSecurity" in out.stderr and "baseline:latest" in out.stderr, out.stderr
    (message, *_) = wait_until(
        "the Job controller's pod creation refused under baseline", lambda: refusals(baseline), ns=baseline
    )
    assert 'violates PodSecurity "baseline:latest"' in message
    assert "hostPath volumes" in message
    assert trainer_pods(baseline, "hp") == []
    kubectl("-n", baseline, "delete", "-f", "-", stdin=rendered)


@pytest.mark.parametrize("mode", ["emptyDir", "ephemeral", "pvc"])
def test_node_local_modes_are_admitted_under_restricted(namespace, mode):
    ns = namespace("restricted")
    values = trainer_values(2, mode)
    if mode == "pvc":
        kubectl("-n", ns, "apply", "-f", "-", stdin=PVC)
    out = install("nl", ns, values)
    assert "would violate PodSecurity" not in out.stderr, out.stderr
    wait_until(
        f"both {mode} trainer pods created in a restricted namespace",
        lambda: len(trainer_pods(ns, "nl")) == 2 or refusals(ns),
        ns=ns,
    )
    assert refusals(ns) == []


PVC = """
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: greenroom-offload}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: greenroom-local
  resources: {requests: {storage: 1Gi}}
"""


def janitor_account(ns: str, release: str) -> str:
    (daemonset,) = [
        d
        for d in kubectl_json("-n", ns, "get", "daemonsets")["items"]
        if d["metadata"]["labels"].get("app.kubernetes.io/instance") == release
    ]
    return f"system:serviceaccount:{ns}:{daemonset['spec']['template']['spec']['serviceAccountName']}"


def can(user: str, *argv: str) -> bool:
    return kubectl("auth", "can-i", *argv, user=user, check=False).stdout.strip() == "yes"


def test_janitor_rbac_is_what_it_needs_and_a_namespace_admin_cannot_install_it(namespace):
    ns = namespace("privileged")
    janitor_install("jan", ns)
    account = janitor_account(ns, "jan")
    # Checked by the API server's RBAC authorizer (SubjectAccessReview), not by us.
    assert can(account, "list", "pods", "--all-namespaces")
    assert not can(account, "watch", "pods", "--all-namespaces")  # never called
    assert can(account, "create", "events", "-n", "default")  # Node events live there
    assert not can(account, "create", "events", "-n", ns)
    assert not can(account, "delete", "pods", "-n", ns)
    assert not can(account, "get", "secrets", "-n", ns)
    assert not can(account, "list", "nodes")

    # A user who administers one namespace only (the built-in `admin` role, bound there).
    other = namespace("privileged")
    kubectl("-n", other, "create", "rolebinding", "alice-admin", "--clusterrole=admin", "--user=alice")
    out = janitor_install("jan2", other, user="alice", check=False)
    assert out.returncode != 0
    assert 'User "alice" cannot' in out.stderr and 'resource "clusterroles"' in out.stderr, out.stderr
    assert "at the cluster scope" in out.stderr, out.stderr


def janitor_objects(ns: str) -> list[str]:
    """What a janitor release in `ns` would own: in it (helm's release record is a Secret
    there), and outside it (named by it)."""
    inside = kubectl("-n", ns, "get", "all,secrets,serviceaccounts,roles,rolebindings", "-o", "name").stdout.split()
    outside = (
        kubectl("get", "clusterroles,clusterrolebindings", "-o", "name").stdout.split()
        + kubectl("-n", "default", "get", "roles,rolebindings", "-o", "name").stdout.split()
    )
    return [n for n in inside if n != "serviceaccount/default"] + [n for n in outside if ns in n]


def refused_in_one_line(out, ns: str, level: str) -> None:
    assert out.returncode != 0
    (line,) = [line for line in out.stderr.splitlines() if "enforces Pod Security" in line]
    assert f'namespace {ns} enforces Pod Security "{level}", and the janitor needs "privileged"' in line, out.stderr
    assert f"kubectl label namespace {ns} pod-security.kubernetes.io/enforce=privileged --overwrite" in line


def test_the_janitor_is_refused_in_one_line_where_pod_security_would_refuse_its_pods(namespace):
    """Refused at install, not installed with its DaemonSet created and each of its pods refused by admission."""
    ns = namespace("baseline")
    refused_in_one_line(janitor_install("jan", ns, check=False), ns, "baseline")
    assert janitor_objects(ns) == []


def test_a_janitor_upgrade_where_pod_security_now_refuses_its_pods_is_refused_and_changes_nothing(namespace):
    """A namespace relabelled after the install: admission leaves the running pods alone but
    would refuse those an upgrade rolls out."""
    ns = namespace("privileged")
    values = janitor_values("/mnt/nvme/greenroom")
    janitor_install("jan", ns, values)
    (daemonset,) = kubectl_json("-n", ns, "get", "daemonsets")["items"]
    kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=baseline", "--overwrite")
    refused = janitor_install("jan", ns, {**values, "intervalSeconds": 3}, action="upgrade", check=False)
    refused_in_one_line(refused, ns, "baseline")
    release = json.loads(helm("-n", ns, "status", "jan", "-o", "json").stdout)
    assert release["info"]["status"] == "deployed" and release["version"] == 1  # no revision recorded
    (after,) = kubectl_json("-n", ns, "get", "daemonsets")["items"]
    assert after["metadata"]["generation"] == daemonset["metadata"]["generation"]


def test_upgrade_then_uninstall_leaves_no_object_behind(namespace):
    ns = namespace("privileged")
    values = trainer_values(2, "hostPath")
    install("up", ns, values)
    wait_until("trainer pods created", lambda: len(trainer_pods(ns, "up")) == 2, ns=ns)
    # A Job's pod template is immutable: the API server refuses an upgrade that changes the
    # trainer (uninstall and install again instead); one that keeps it goes through.
    refused = install(
        "up", ns, {**values, "podLabels": {"greenroom-test/upgraded": "yes"}}, action="upgrade", check=False
    )
    assert refused.returncode != 0 and "field is immutable" in refused.stderr, refused.stderr
    install("up", ns, values, action="upgrade")
    release = json.loads(helm("-n", ns, "status", "up", "-o", "json").stdout)
    assert release["info"]["status"] == "deployed" and release["version"] == 3  # install, refused, upgrade
    helm("-n", ns, "uninstall", "up", "--wait")

    def leftovers() -> list[str]:
        kinds = "all,configmaps,secrets,serviceaccounts,roles,rolebindings,events.events.k8s.io"
        names = kubectl("-n", ns, "get", kinds, "-o", "name").stdout.split()
        cluster_scoped = kubectl(
            "get", "clusterroles,clusterrolebindings", "-l", "app.kubernetes.io/instance=up", "-o", "name"
        ).stdout.split()
        # What the namespace always holds (its default ServiceAccount and CA ConfigMap),
        # and Events (records of what happened, not objects the release owns).
        kept = {"serviceaccount/default", "configmap/kube-root-ca.crt"}
        return [n for n in names + cluster_scoped if n not in kept and not n.startswith("event")]

    wait_until(
        "nothing left of the release (pods removed by the garbage collector)",
        lambda: not leftovers(),
        timeout=120,
        ns=ns,
    )


def test_jobset_mode_creates_the_trainer_pods(namespace):
    require_cluster("jobset")
    ns = namespace("privileged")
    install("js", ns, trainer_values(2, "hostPath", workload="jobset"))
    (jobset,) = kubectl_json("-n", ns, "get", "jobsets")["items"]
    wait_until(
        "the JobSet controller's Job and its two pods",
        lambda: len(pods(ns, f"jobset.sigs.k8s.io/jobset-name={jobset['metadata']['name']}")) == 2,
        ns=ns,
    )
    assert refusals(ns) == []
