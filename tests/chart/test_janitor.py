"""The greenroom-janitor chart (deploy/helm/greenroom-janitor), rendered by the real helm
binary: once per cluster, the only chart with cluster-scoped RBAC."""

import argparse
import json
import os
import shutil
import subprocess

import pytest
import yaml

from tests.chart.support import JANITOR_CHART, by_kind, helm, manifests, readme_lacks, render
from tests.conftest import require_tool

pytestmark = pytest.mark.helm


@pytest.mark.parametrize("values", [None, "metrics.yaml"])
def test_helm_lint_strict_passes(values):
    argv = ["lint", "--strict", JANITOR_CHART] + (["-f", os.path.join(JANITOR_CHART, "ci", values)] if values else [])
    out = helm(*argv)
    assert out.returncode == 0, out.stdout + out.stderr


def test_janitor_has_least_privilege_and_a_metrics_service():
    docs = manifests("metrics.yaml", chart=JANITOR_CHART)
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    (sa,) = by_kind(docs, "ServiceAccount")
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and pod["automountServiceAccountToken"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["priorityClassName"] == "system-node-critical"
    (c,) = pod["containers"]
    assert c["command"] == [
        "greenroom",
        "reclaim",
        "/greenroom/node",
        "--kubernetes",
        "--node-name",
        "$(NODE_NAME)",
        "--interval",
        "120",
        "--metrics-port",
        "9400",
    ]
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    # The hostPath root is its only writable path.
    assert c["volumeMounts"] == [{"name": "offload-root", "mountPath": "/greenroom/node"}]
    root = {"path": "/mnt/nvme/greenroom", "type": "Directory"}
    assert pod["volumes"] == [{"name": "offload-root", "hostPath": root}]
    (svc,) = by_kind(docs, "Service")
    assert svc["metadata"]["labels"]["release"] == "prometheus"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]


def test_janitor_rbac_grants_only_the_two_calls_it_makes():
    """It lists pods (every namespace, its node) and creates Events in "default"
    (greenroom.dirs.janitor.EVENT_NAMESPACE): no get or watch on pods, which it never calls, and no
    create on events in every namespace of the cluster."""
    from greenroom.dirs.janitor import EVENT_NAMESPACE

    docs = manifests(chart=JANITOR_CHART)
    (sa,) = by_kind(docs, "ServiceAccount")
    subject = [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "train"}]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    (cluster_binding,) = by_kind(docs, "ClusterRoleBinding")
    assert cluster_binding["subjects"] == subject
    assert cluster_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": cluster_role["metadata"]["name"],
    }
    (role,) = by_kind(docs, "Role")
    assert role["metadata"]["namespace"] == EVENT_NAMESPACE
    assert role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["metadata"]["namespace"] == EVENT_NAMESPACE and binding["subjects"] == subject
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }


def test_objects_outside_the_release_namespace_are_named_by_it():
    """The ClusterRole, its binding and the Role in "default" are shared by every
    namespace: two releases of one name in two namespaces must not claim the same ones."""

    def names(ns):
        out = helm("template", "jan", JANITOR_CHART, "--namespace", ns)
        assert out.returncode == 0, out.stderr
        return {
            (d["kind"], d["metadata"]["name"])
            for d in yaml.safe_load_all(out.stdout)
            if d and d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
        }

    one, other = names("ops-a"), names("ops-b")
    assert len(one) == 4 and not one & other


def test_a_trainers_uid_janitor_adds_no_capability():
    (ds,) = by_kind(manifests(sets=("runAsUser=1000",), chart=JANITOR_CHART), "DaemonSet")
    sc = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert not by_kind(manifests(chart=JANITOR_CHART), "Service")  # metrics Service off by default


@pytest.mark.parametrize(
    "value, message",
    [
        # Rendered, then every janitor exited 2 on "--interval must be ... at most 86400".
        ("intervalSeconds=86401", "at '/intervalSeconds': maximum: got 86,401, want 86,400"),
        # Rendered a second app.kubernetes.io/name key: pods its DaemonSet's selector does not match.
        ("podLabels.app\\.kubernetes\\.io/name=mine", "podLabels may not set a label the chart sets"),
        (
            "metricsService.labels.app\\.kubernetes\\.io/part-of=x",
            "metricsService.labels may not set a label the chart sets",
        ),
        ("tolerations[0]=gpu", "at '/tolerations/0': got string, want object"),
    ],
)
def test_values_that_rendered_a_broken_janitor_are_refused_naming_the_key(value, message):
    out = helm("template", "rel", JANITOR_CHART, "--set", "metricsService.enabled=true", "--set", value)
    assert out.returncode != 0, f"helm template accepted {value}"
    assert any(message in line for line in out.stderr.splitlines()), out.stderr


def test_the_longest_interval_renders_and_parses():
    (ds,) = by_kind(manifests(sets=("intervalSeconds=86400", "podLabels.team=rl"), chart=JANITOR_CHART), "DaemonSet")
    assert ds["spec"]["template"]["metadata"]["labels"]["team"] == "rl"
    command = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--interval") + 1] == "86400"


def test_the_janitor_is_told_its_node_and_its_own_pod():
    """Its own pod must be in every listing of its node (greenroom.dirs.k8s_api.check_listing): a wrong
    node name makes every pod's dir look gone. The chart sets POD_NAME so there is a pod to check."""
    (ds,) = by_kind(manifests(chart=JANITOR_CHART), "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]} == {
        "NODE_NAME": "spec.nodeName",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_NAME": "metadata.name",
    }


def test_janitor_command_parses_with_greenroom_reclaims_own_parser():
    from greenroom.cli.reclaim import configure_parser

    parser = argparse.ArgumentParser(exit_on_error=False)
    configure_parser(parser)
    (ds,) = by_kind(manifests(chart=JANITOR_CHART), "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    args = parser.parse_args([a.replace("$(NODE_NAME)", "node-1") for a in c["command"][2:]])
    assert args.root == "/greenroom/node"


@pytest.mark.parametrize("run_as_user", [0, 1000])
def test_notes_give_the_reason_pod_security_gives(run_as_user):
    """Kubernetes' own checks refuse the janitor under baseline for its hostPath volume alone
    (tests/chart/test_security.py); the NOTES said root with DAC_OVERRIDE needed privileged too."""
    out = helm(
        "install", "jan", JANITOR_CHART, "--namespace", "ops", "--dry-run=client", "--set", f"runAsUser={run_as_user}"
    )
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if "Pod Security" in line]
    assert line.startswith('It needs the "privileged" Pod Security level in ops: baseline refuses its hostPath volume')
    assert ("DAC_OVERRIDE passes baseline" in line) == (run_as_user == 0)


NAMESPACE_LOOKUP = 'lookup "v1" "Namespace" "" .Release.Namespace'


def chart_in_namespace(tmp_path, namespace: dict) -> str:
    """A copy of the janitor chart whose lookup of its namespace answers `namespace` ({}:
    not there, as lookup answers). helm template does no lookup; tests/k8s/test_admission.py
    runs the real one."""
    chart = tmp_path / "greenroom-janitor"
    shutil.copytree(JANITOR_CHART, chart)
    validate = chart / "templates" / "_validate.tpl"
    source = validate.read_text()
    assert source.count(NAMESPACE_LOOKUP) == 1
    validate.write_text(source.replace(NAMESPACE_LOOKUP, f"fromJson {json.dumps(json.dumps(namespace))}"))
    return str(chart)


@pytest.mark.parametrize("run_as_user", [0, 1000])
@pytest.mark.parametrize(
    "labels",
    [
        {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/enforce-version": "v1.30"},
        {"pod-security.kubernetes.io/enforce": "restricted"},
    ],
)
def test_a_namespace_whose_pod_security_refuses_the_janitor_is_refused_in_one_line(tmp_path, labels, run_as_user):
    """Refused, not a DaemonSet created with every janitor pod refused by admission. Its hostPath
    volume needs privileged whatever its uid and the level's version."""
    chart = chart_in_namespace(tmp_path, {"metadata": {"name": "ops", "labels": labels}})
    out = helm("template", "jan", chart, "--namespace", "ops", "--set", f"runAsUser={run_as_user}")
    assert out.returncode != 0
    (line,) = [line for line in out.stderr.splitlines() if "Pod Security" in line]
    level = labels["pod-security.kubernetes.io/enforce"]
    assert line.endswith(
        f'namespace ops enforces Pod Security "{level}", and the janitor needs "privileged" (a hostPath volume, '
        "the node root /mnt/nvme/greenroom): label it (kubectl label namespace ops "
        "pod-security.kubernetes.io/enforce=privileged --overwrite) or install into a privileged namespace"
    ), line


@pytest.mark.parametrize(
    "namespace",
    [
        {},  # not there yet (--create-namespace), and what helm template sees
        {"metadata": {"name": "ops"}},  # no level of its own: the cluster's default, which no object shows
        {"metadata": {"name": "ops", "labels": {"pod-security.kubernetes.io/enforce": "privileged"}}},
        {"metadata": {"name": "ops", "labels": {"pod-security.kubernetes.io/warn": "baseline"}}},
    ],
)
def test_the_pod_security_check_says_nothing_unless_the_namespace_enforces_a_level_that_refuses(tmp_path, namespace):
    out = helm("template", "jan", chart_in_namespace(tmp_path, namespace), "--namespace", "ops")
    assert out.returncode == 0, out.stderr
    # The same manifests as the chart under helm template, where lookup finds nothing.
    plain = helm("template", "jan", JANITOR_CHART, "--namespace", "ops")
    assert plain.returncode == 0, plain.stderr
    assert out.stdout == plain.stdout


def test_janitor_readme_documents_every_value():
    assert not readme_lacks(JANITOR_CHART, ("resources",))


def test_every_rendered_manifest_validates_strictly(tmp_path):
    validate = require_tool("kubernetes-validate")
    path = tmp_path / "janitor.yaml"
    path.write_text(render("metrics.yaml", chart=JANITOR_CHART, kube_version="1.35.0"))
    out = subprocess.run([validate, "--strict", "--no-warn", "-k", "1.35.0", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed for resource") == 7
