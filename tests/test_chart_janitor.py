"""The greenroom-janitor chart (deploy/helm/greenroom-janitor), rendered by the real helm
binary: once per cluster, the only chart with cluster-scoped RBAC."""

import argparse
import os
import subprocess

import pytest

from tests.chart_support import JANITOR_CHART, by_kind, helm, manifests, readme_lacks, render
from tests.conftest import require_tool

pytestmark = pytest.mark.helm


@pytest.mark.parametrize("values", [None, "metrics.yaml"])
def test_helm_lint_strict_passes(values):
    argv = ["lint", "--strict", JANITOR_CHART] + (["-f", os.path.join(JANITOR_CHART, "ci", values)] if values else [])
    out = helm(*argv)
    assert out.returncode == 0, out.stdout + out.stderr


def test_janitor_has_least_privilege_and_a_metrics_service():
    docs = manifests("metrics.yaml", chart=JANITOR_CHART)
    assert sorted(d["kind"] for d in docs) == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "Service",
                                               "ServiceAccount"]
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    (sa,) = by_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "train"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"] and pod["automountServiceAccountToken"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["priorityClassName"] == "system-node-critical"
    (c,) = pod["containers"]
    assert c["command"] == ["greenroom", "reclaim", "/greenroom/node", "--kubernetes", "--node-name",
                            "$(NODE_NAME)", "--interval", "120", "--metrics-port", "9400"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    # The hostPath root is its only writable path.
    assert c["volumeMounts"] == [{"name": "offload-root", "mountPath": "/greenroom/node"}]
    assert pod["volumes"] == [{"name": "offload-root", "hostPath": {"path": "/mnt/nvme/greenroom", "type": "Directory"}}]
    (svc,) = by_kind(docs, "Service")
    assert svc["metadata"]["labels"]["release"] == "prometheus"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]


def test_a_trainers_uid_janitor_adds_no_capability():
    (ds,) = by_kind(manifests(sets=("runAsUser=1000",), chart=JANITOR_CHART), "DaemonSet")
    sc = ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["capabilities"] == {"drop": ["ALL"]}
    assert not by_kind(manifests(chart=JANITOR_CHART), "Service")  # metrics Service off by default


def test_janitor_command_parses_with_greenroom_reclaims_own_parser():
    from greenroom.reclaim_cli import configure_parser
    parser = argparse.ArgumentParser(exit_on_error=False)
    configure_parser(parser)
    (ds,) = by_kind(manifests(chart=JANITOR_CHART), "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    args = parser.parse_args([a.replace("$(NODE_NAME)", "node-1") for a in c["command"][2:]])
    assert args.root == "/greenroom/node"


def test_janitor_readme_documents_every_value():
    assert not readme_lacks(JANITOR_CHART, ("resources",))


def test_every_rendered_manifest_validates_strictly(tmp_path):
    validate = require_tool("kubernetes-validate")
    path = tmp_path / "janitor.yaml"
    path.write_text(render("metrics.yaml", chart=JANITOR_CHART, kube_version="1.35.0"))
    out = subprocess.run([validate, "--strict", "--no-warn", "-k", "1.35.0", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("passed for resource") == 5
