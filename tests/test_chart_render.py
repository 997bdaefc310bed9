"""The Helm chart rendered by the real helm binary (helm lint --strict, helm template) for
every values file in deploy/helm/greenroom/ci/, and every manifest validated by
kubernetes-validate --strict against Kubernetes 1.30 to 1.35.

No Kubernetes API server can run here: these tests check what the chart renders (structure,
API schemas, flags, security settings), not how a cluster schedules or runs it.
"""

import argparse
import os
import subprocess
import tarfile

import pytest
import yaml

from tests.chart_support import CHART, CI_VALUES, by_kind, container, helm, manifests, pod_spec, render
from tests.conftest import REPO, require_tool

pytestmark = pytest.mark.helm

# Versions kubernetes-validate 1.37.0 ships schemas for (an unknown version passes silently).
KUBE_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0"]


def test_ci_values_files_cover_the_issues_matrix():
    assert set(CI_VALUES) >= {"cpu-target.yaml", "disk-target.yaml", "streaming.yaml", "both.yaml",
                              "jobset.yaml", "emptydir.yaml", "janitor.yaml"}


@pytest.mark.parametrize("values", [None] + CI_VALUES)
def test_helm_lint_strict_passes(values):
    argv = ["lint", "--strict", CHART] + (["-f", os.path.join(CHART, "ci", values)] if values else [])
    out = helm(*argv)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


def _validatable(docs: list[dict]) -> list[dict]:
    """kubernetes-validate has no JobSet schema: validate the JobSet's Job template as a Job."""
    out = []
    for d in docs:
        if d["kind"] == "JobSet":
            for rj in d["spec"]["replicatedJobs"]:
                out.append({"apiVersion": "batch/v1", "kind": "Job",
                            "metadata": {"name": f"{d['metadata']['name']}-{rj['name']}-0", **rj["template"]["metadata"]},
                            "spec": rj["template"]["spec"]})
        else:
            out.append(d)
    return out


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_rendered_manifest_validates_strictly(kube_version, tmp_path):
    validate = require_tool("kubernetes-validate")
    files = []
    for values in CI_VALUES:
        docs = [d for d in yaml.safe_load_all(render(values, kube_version=kube_version)) if d]
        path = tmp_path / values
        path.write_text(yaml.safe_dump_all(_validatable(docs)))
        files.append(str(path))
    out = subprocess.run([validate, "--strict", "--no-warn", "-k", kube_version, *files],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout and "WARN" not in out.stdout
    assert out.stdout.count(f"passed for resource") >= 2 * len(CI_VALUES)


def test_default_is_an_indexed_job_with_a_headless_service_failing_fast():
    docs = manifests()
    assert sorted(d["kind"] for d in docs) == ["Job", "Service"]
    (job,) = by_kind(docs, "Job")
    (svc,) = by_kind(docs, "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 1
    assert spec["backoffLimit"] == 0
    assert spec["podReplacementPolicy"] == "Failed"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == job["metadata"]["name"]
    assert pod["restartPolicy"] == "Never"
    labels = job["metadata"]["labels"]
    for key in ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                "app.kubernetes.io/version", "app.kubernetes.io/managed-by"):
        assert key in labels


def test_default_command_is_torchrun_running_greenroom_train_with_the_seed_flags():
    docs = manifests("disk-target.yaml")
    trainer = container(pod_spec(docs), "trainer")
    assert trainer["command"] == ["torchrun"]
    args = trainer["args"]
    assert args[:6] == ["--nnodes=2", "--nproc-per-node=8", "--node-rank=$(GREENROOM_NODE_RANK)",
                        "--master-addr=$(GREENROOM_MASTER_ADDR)", "--master-port=29500", "--no-python"]
    assert args[6:] == ["greenroom", "train", "--offload-train", "--offload-train-target", "disk",
                        "--offload-train-disk-dir", "/var/lib/greenroom/offload",
                        "--offload-train-disk-chunk-mb", "128", "--offload-train-disk-compression", "auto",
                        "--iterations", "100", "--role", "actor",
                        "--save", "/checkpoints/run1"]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["GREENROOM_MASTER_ADDR"]["value"] == "rel-greenroom-0.rel-greenroom"
    assert env["GREENROOM_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/job-completion-index']"
    assert env["GREENROOM_JOB_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8


DISK_DIR = ["--offload-train-disk-dir", "/var/lib/greenroom/offload", "--offload-train-disk-chunk-mb", "256",
            "--offload-train-disk-compression", "auto"]


@pytest.mark.parametrize("values, expected", [
    ("cpu-target.yaml", ["--offload-train", "--offload-train-target", "cpu", *DISK_DIR, "--role", "actor"]),
    # Streaming alone (the disaggregated case): no actor offload flags at all.
    ("streaming.yaml", [*DISK_DIR, "--stream-optimizer-state-to-disk", "--stream-optimizer-state-moment-dtype",
                        "bf16", "--no-load-optim", "--role", "actor", "--load", "/checkpoints/run1"]),
    ("both.yaml", ["--offload-train", "--offload-train-target", "disk", *DISK_DIR,
                   "--stream-optimizer-state-to-disk", "--stream-optimizer-state-moment-dtype", "fp8e4m3",
                   "--stream-optimizer-state-host-cache-gb", "0.5", "--role", "actor"]),
])
def test_each_seed_value_becomes_its_exact_flag(values, expected):
    args = container(pod_spec(manifests(values)), "trainer")["args"]
    assert args[args.index("greenroom"):] == ["greenroom", "train", *expected]


def test_the_rendered_train_arguments_parse_with_greenroom_trains_own_parser():
    from greenroom.train.main import configure_parser
    for values in ("cpu-target.yaml", "disk-target.yaml", "streaming.yaml", "both.yaml", "jobset.yaml"):
        args = container(pod_spec(manifests(values)), "trainer")["args"]
        train = args[args.index("train") + 1:]
        parser = argparse.ArgumentParser(exit_on_error=False)
        configure_parser(parser)
        parser.parse_args(train)


def test_any_trainer_command_is_used_as_given():
    trainer = container(pod_spec(manifests("custom-command.yaml")), "trainer")
    assert trainer["command"] == ["python", "-m", "my_trainer"]
    assert trainer["args"] == ["--config", "/configs/run.yaml"]
    assert "lifecycle" not in trainer
    assert "resources" not in trainer


def test_trainer_pods_are_non_root_without_api_access_or_privileges():
    spec = pod_spec(manifests())
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    trainer = container(spec, "trainer")
    assert trainer["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    init = container(spec, "prepare-offload-dir", init=True)
    # Root only in the init container, with only what chown and reclaim need.
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_node_local_nvme_is_a_hostpath_directory_mounted_per_pod():
    spec = pod_spec(manifests())
    (vol,) = [v for v in spec["volumes"] if v["name"] == "offload"]
    assert vol["hostPath"] == {"path": "/mnt/nvme/greenroom", "type": "Directory"}
    (mount,) = [m for m in container(spec, "trainer")["volumeMounts"] if m["name"] == "offload"]
    assert mount == {"name": "offload", "mountPath": "/var/lib/greenroom/offload",
                     "subPathExpr": "$(GREENROOM_POD_UID)"}
    (init_mount,) = container(spec, "prepare-offload-dir", init=True)["volumeMounts"]
    assert init_mount == {"name": "offload", "mountPath": "/greenroom/node"}
    both = pod_spec(manifests("both.yaml"))
    (vol,) = [v for v in both["volumes"] if v["name"] == "offload"]
    assert vol["hostPath"]["type"] == "DirectoryOrCreate"


def test_emptydir_storage_is_disk_backed_with_a_size_limit():
    spec = pod_spec(manifests("emptydir.yaml"))
    (vol,) = [v for v in spec["volumes"] if v["name"] == "offload"]
    assert vol == {"name": "offload", "emptyDir": {"sizeLimit": "500Gi"}}  # no medium: disk


def test_scheduling_values_reach_the_pod():
    spec = pod_spec(manifests("disk-target.yaml"))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["priorityClassName"] == "training"
    assert spec["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert spec["terminationGracePeriodSeconds"] == 60
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in container(spec, "trainer")["volumeMounts"]
    both = pod_spec(manifests("both.yaml"))
    assert "nodeAffinity" in both["affinity"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container(both, "trainer")["env"]


def test_jobset_variant_fails_fast_and_names_its_rendezvous_host():
    docs = manifests("jobset.yaml")
    assert sorted(d["kind"] for d in docs) == ["JobSet"]  # JobSet makes its own Service
    (js,) = docs
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    (rj,) = js["spec"]["replicatedJobs"]
    assert rj["template"]["spec"]["completions"] == 4 and rj["template"]["spec"]["backoffLimit"] == 0
    trainer = container(rj["template"]["spec"]["template"]["spec"], "trainer")
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["GREENROOM_MASTER_ADDR"] == "rel-greenroom-trainer-0-0.rel-greenroom"


def test_janitor_has_least_privilege_and_a_metrics_service():
    docs = manifests("janitor.yaml")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "Job", "Service", "Service", "ServiceAccount"]
    (role,) = by_kind(docs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    (sa,) = by_kind(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "train"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    (c,) = pod["containers"]
    assert c["command"] == ["greenroom", "reclaim", "/greenroom/node", "--kubernetes", "--node-name",
                            "$(NODE_NAME)", "--interval", "120", "--metrics-port", "9400"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    # The hostPath root is its only writable path.
    assert c["volumeMounts"] == [{"name": "offload-root", "mountPath": "/greenroom/node"}]
    assert pod["volumes"] == [{"name": "offload-root", "hostPath": {"path": "/mnt/nvme/greenroom", "type": "Directory"}}]
    metrics = [s for s in by_kind(docs, "Service") if s["metadata"]["name"].endswith("-janitor-metrics")]
    (svc,) = metrics
    assert svc["metadata"]["labels"]["release"] == "prometheus"
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics"}]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "janitor"
    assert container(pod_spec(docs), "trainer")  # the trainer's Job is still there
    assert pod_spec(docs)["automountServiceAccountToken"] is False


def test_janitor_metrics_service_is_off_by_default():
    docs = manifests(sets=("janitor.enabled=true",))
    assert not [s for s in by_kind(docs, "Service") if "janitor" in s["metadata"]["name"]]


def test_notes_tell_how_to_follow_the_job():
    out = helm("install", "rel", CHART, "--dry-run=client", "--namespace", "train")
    assert out.returncode == 0, out.stderr
    assert "kubectl -n train get job rel-greenroom -w" in out.stdout
    assert "logs -f -l batch.kubernetes.io/job-name=rel-greenroom" in out.stdout


def test_chart_readme_documents_every_value():
    readme = open(os.path.join(CHART, "README.md"), encoding="utf-8").read()
    values = yaml.safe_load(open(os.path.join(CHART, "values.yaml"), encoding="utf-8"))

    def keys(d, prefix=""):
        for k, v in d.items():
            path = f"{prefix}{k}"
            yield path
            if isinstance(v, dict) and v and path not in ("resources", "podSecurityContext", "securityContext",
                                                         "reclaim.initContainer.resources", "janitor.resources"):
                yield from keys(v, path + ".")

    missing = [k for k in keys(values) if f"`{k}`" not in readme]
    assert not missing, f"README.md lacks {missing}"


def test_janitor_command_parses_with_greenroom_reclaims_own_parser():
    from greenroom.reclaim_cli import configure_parser
    parser = argparse.ArgumentParser(exit_on_error=False)
    configure_parser(parser)
    if "--kubernetes" not in parser._option_string_actions:
        pytest.skip("greenroom reclaim has no --kubernetes yet (issue 9): the janitor DaemonSet needs it")
    (ds,) = by_kind(manifests("janitor.yaml"), "DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    argv = [a.replace("$(NODE_NAME)", "node-1") for a in c["command"][2:]]
    args = parser.parse_args(argv)
    assert args.root == "/greenroom/node"


def test_helm_package_leaves_the_ci_values_out(tmp_path):
    out = helm("package", CHART, "--destination", str(tmp_path))
    assert out.returncode == 0, out.stderr
    with tarfile.open(tmp_path / "greenroom-0.1.0.tgz") as tgz:
        names = tgz.getnames()
    assert "greenroom/values.schema.json" in names and "greenroom/README.md" in names
    assert not [n for n in names if n.startswith("greenroom/ci/")]


def _flags_from_values(values_file: str):
    """The seed flags the chart's values describe, as ``OffloadFlags`` (the Python side
    of the mapping, so the chart's template is checked against ``to_argv``)."""
    from greenroom.config import OffloadFlags
    with open(os.path.join(REPO, "deploy", "helm", "greenroom", "values.yaml")) as f:
        v = yaml.safe_load(f)
    with open(os.path.join(REPO, "deploy", "helm", "greenroom", "ci", values_file)) as f:
        for key, value in (yaml.safe_load(f) or {}).items():
            v[key] = {**v[key], **value} if isinstance(value, dict) and isinstance(v.get(key), dict) else value
    return OffloadFlags(offload_train=v["offload"]["train"],
                        offload_train_target=v["offload"]["target"] if v["offload"]["train"] else None,
                        offload_train_disk_dir=v["storage"]["mountPath"],
                        offload_train_disk_chunk_mb=v["offload"]["diskChunkMb"],
                        stream_optimizer_state_to_disk=v["streamOptimizerState"]["toDisk"],
                        stream_optimizer_state_moment_dtype=v["streamOptimizerState"]["momentDtype"],
                        stream_optimizer_state_host_cache_gb=v["streamOptimizerState"]["hostCacheGb"],
                        no_load_optim=v["noLoadOptim"])


@pytest.mark.parametrize("values", CI_VALUES)
def test_the_charts_seed_flags_are_exactly_offload_flags_to_argv(values):
    if values == "custom-command.yaml":
        pytest.skip("custom-command.yaml replaces the trainer command: the chart renders no seed flags")
    trainer = container(pod_spec(manifests(values)), "trainer")
    argv = trainer.get("args") or trainer["command"]
    train = argv[argv.index("train") + 1:]
    expected = _flags_from_values(values).to_argv()
    assert train[:len(expected)] == expected
