"""The Helm chart rendered by the real helm binary (helm lint --strict, helm template) for
every values file in deploy/helm/greenroom/ci/, and every manifest validated by
kubernetes-validate --strict against Kubernetes 1.30 to 1.35.

No Kubernetes API server runs in these tests: they check what the chart renders (structure,
API schemas, flags, env), not how a cluster schedules or runs it.
"""

import argparse
import os
import shlex
import subprocess
import tarfile

import pytest
import yaml

from tests.chart.support import (
    CHART,
    CI_VALUES,
    JANITOR_CHART,
    by_kind,
    container,
    helm,
    manifests,
    pod_spec,
    readme_lacks,
    render,
)
from tests.conftest import require_tool

pytestmark = pytest.mark.helm

# Versions kubernetes-validate 1.37.0 ships schemas for (an unknown version passes silently).
KUBE_VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0"]
STORAGE_MODES = {"hostPath": None, "emptyDir": "emptydir.yaml", "ephemeral": "ephemeral.yaml", "pvc": "pvc.yaml"}


def env_of(c: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def argv_of(c: dict) -> list[str]:
    return c["command"] + c["args"]


def test_ci_values_files_cover_the_issues_matrix():
    assert set(CI_VALUES) >= {
        "cpu-target.yaml",
        "disk-target.yaml",
        "streaming.yaml",
        "both.yaml",
        "jobset.yaml",
        "emptydir.yaml",
        "ephemeral.yaml",
        "pvc.yaml",
        "custom-command.yaml",
        "scheduling.yaml",
    }


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
                out.append(
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "metadata": {"name": f"{d['metadata']['name']}-{rj['name']}-0", **rj["template"]["metadata"]},
                        "spec": rj["template"]["spec"],
                    }
                )
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
    out = subprocess.run(
        [validate, "--strict", "--no-warn", "-k", kube_version, *files], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout and "WARN" not in out.stdout
    assert out.stdout.count("passed for resource") >= len(CI_VALUES) + 1


def test_default_is_an_indexed_job_that_restarts_a_disrupted_rank_and_fails_on_a_config_error():
    docs = manifests()
    assert sorted(d["kind"] for d in docs) == ["Job", "Service"]
    (job,) = by_kind(docs, "Job")
    (svc,) = by_kind(docs, "Service")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 1
    assert spec["backoffLimitPerIndex"] == 3 and spec["maxFailedIndexes"] == 0 and "backoffLimit" not in spec
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}},
        {"action": "Count", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [143]}},
    ]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == job["metadata"]["name"]
    assert pod["restartPolicy"] == "Never"
    assert job["metadata"]["namespace"] == svc["metadata"]["namespace"] == "train"
    for key in (
        "helm.sh/chart",
        "app.kubernetes.io/name",
        "app.kubernetes.io/instance",
        "app.kubernetes.io/version",
        "app.kubernetes.io/managed-by",
    ):
        assert key in job["metadata"]["labels"]


def test_default_command_is_torchrun_running_greenroom_train_with_the_seed_flags_appended():
    trainer = container(pod_spec(manifests("disk-target.yaml")), "trainer")
    assert trainer["command"] == ["greenroom", "torchrun"]
    args = trainer["args"]
    assert args[:7] == [
        "--nnodes=2",
        "--nproc-per-node=8",
        "--node-rank=$(NODE_RANK)",
        "--master-addr=$(MASTER_ADDR)",
        "--master-port=$(MASTER_PORT)",
        "--rdzv-conf=timeout=300",
        "--no-python",
    ]
    assert args[7:] == [
        "greenroom",
        "train",
        "--iterations",
        "100",
        "--role",
        "actor",
        "--save",
        "/checkpoints/run1",
        "--load",
        "/checkpoints/run1",
        "--resume",
        "auto",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        "/var/lib/greenroom/offload",
        "--offload-train-disk-chunk-mb",
        "128",
        "--offload-train-disk-compression",
        "auto",
    ]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_the_distributed_env_every_launcher_expects_is_exported():
    env = env_of(container(pod_spec(manifests("disk-target.yaml")), "trainer"))
    index = {"fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/job-completion-index']"}}
    assert env["NODE_RANK"] == index
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["WORLD_SIZE"]) == ("2", "8", "16")
    # The index-0 pod's stable DNS name (Indexed Job hostname under the headless Service).
    assert env["MASTER_ADDR"] == "rel-greenroom-0.rel-greenroom" and env["MASTER_PORT"] == "29500"
    assert env["GREENROOM_DISK_DIR"] == "/var/lib/greenroom/offload"
    assert env["GREENROOM_JOB_ID"] == {
        "fieldRef": {"fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}
    }
    assert "RANK" not in env  # torchrun sets it per process
    single = env_of(container(pod_spec(manifests(sets=("torchrun.enabled=false", "nodes=3"))), "trainer"))
    assert single["RANK"] == index and single["LOCAL_RANK"] == "0" and single["WORLD_SIZE"] == "3"
    js = env_of(container(pod_spec(manifests("jobset.yaml")), "trainer"))
    assert js["MASTER_ADDR"] == "rel-greenroom-trainer-0-0.rel-greenroom"


@pytest.mark.parametrize("values", CI_VALUES)
def test_greenroom_args_is_offload_flags_to_argv_and_reads_back_with_from_env(values):
    """The chart's side of the mapping checked against the Python side: GREENROOM_ARGS
    parses (OffloadConfig.from_env's parser) to flags whose to_argv() is the same words."""
    from greenroom.config import OffloadFlags, _flags_parser, env_argv

    trainer = container(pod_spec(manifests(values)), "trainer")
    text = env_of(trainer)["GREENROOM_ARGS"]
    ns = _flags_parser().parse_args(env_argv({"GREENROOM_ARGS": text}))
    flags = OffloadFlags.from_args(ns)
    assert shlex.join(flags.to_argv()) == text
    argv = argv_of(trainer)
    appended = argv[-len(flags.to_argv()) :] == flags.to_argv()
    assert appended == (values != "custom-command.yaml")  # auto: env only for your own command


@pytest.mark.parametrize(
    "values, expected",
    [
        ("cpu-target.yaml", ["--offload-train", "--offload-train-target", "cpu"]),
        # Streaming alone (the disaggregated case): no actor offload flags at all.
        (
            "streaming.yaml",
            ["--stream-optimizer-state-to-disk", "--stream-optimizer-state-moment-dtype", "bf16", "--no-load-optim"],
        ),
        (
            "both.yaml",
            [
                "--offload-train",
                "--offload-train-target",
                "disk",
                "--stream-optimizer-state-to-disk",
                "--stream-optimizer-state-moment-dtype",
                "fp8e4m3",
                "--stream-optimizer-state-master-layout",
                "fp32",
                "--stream-optimizer-state-host-cache-gb",
                "0.5",
            ],
        ),
    ],
)
def test_each_seed_value_becomes_its_exact_flag(values, expected):
    words = shlex.split(env_of(container(pod_spec(manifests(values)), "trainer"))["GREENROOM_ARGS"])
    for flag in expected:
        assert flag in words
    assert [
        w
        for w in words
        if w.startswith("--offload-train")
        and w != "--offload-train-disk-dir"
        and w not in ("--offload-train-disk-chunk-mb", "--offload-train-disk-compression")
    ] == [w for w in expected if w.startswith("--offload-train")]


def test_the_rendered_train_arguments_parse_with_greenroom_trains_own_parser():
    from greenroom.cli.train import configure_parser

    for values in ("cpu-target.yaml", "disk-target.yaml", "streaming.yaml", "both.yaml", "jobset.yaml"):
        args = container(pod_spec(manifests(values)), "trainer")["args"]
        train = args[args.index("train") + 1 :]
        parser = argparse.ArgumentParser(exit_on_error=False)
        configure_parser(parser)
        parser.parse_args(train)


def test_any_trainer_runs_its_own_image_and_command_under_torchrun_with_the_flags_in_the_env():
    trainer = container(pod_spec(manifests("custom-command.yaml")), "trainer")
    assert trainer["image"] == "registry.example.com/team/hf-trainer:2.1"
    assert trainer["command"] == ["greenroom", "torchrun"]
    assert trainer["args"][-4:] == ["--no-python", "python", "/app/hf_trainer.py", "/checkpoints/run1"]
    assert "--nproc-per-node=2" in trainer["args"]
    env = env_of(trainer)
    assert "--stream-optimizer-state-moment-dtype bf16" in env["GREENROOM_ARGS"]
    appended = container(pod_spec(manifests("custom-command.yaml", sets=("greenroomArgs=append",))), "trainer")
    flags = shlex.split(env["GREENROOM_ARGS"])
    assert appended["args"][-len(flags) - 2 :] == ["/app/hf_trainer.py", "/checkpoints/run1", *flags]
    bare = container(
        pod_spec(manifests(sets=("command={python,t.py}", "args={--x}", "torchrun.enabled=false"))), "trainer"
    )
    assert bare["command"] == ["python", "t.py"] and bare["args"] == ["--x"]


def test_resume_is_auto_and_strict_on_request():
    args = container(pod_spec(manifests("streaming.yaml", sets=("train.resume=strict",))), "trainer")["args"]
    assert args[args.index("--load") :][:4] == ["--load", "/checkpoints/run1", "--resume", "strict"]


def test_trainer_pods_are_non_root_without_api_access_or_privileges():
    spec = pod_spec(manifests())
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000
    trainer = container(spec, "trainer")
    assert trainer["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    init = container(spec, "prepare-offload-dir", init=True)
    # hostPath mode: root only in the init container, with only what chown and reclaim need.
    assert init["securityContext"]["runAsUser"] == 0
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "FOWNER"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_a_root_trainer_gets_its_dir_as_root_and_a_container_uid_wins_over_the_pods():
    # uid/gid 0 is root, not "unset": the init container gives the pod's dir to 0:0.
    root = manifests(
        sets=(
            "podSecurityContext.runAsUser=0",
            "podSecurityContext.runAsGroup=0",
            "podSecurityContext.runAsNonRoot=false",
        )
    )
    init = env_of(container(pod_spec(root), "prepare-offload-dir", init=True))
    assert (init["GREENROOM_TRAINER_UID"], init["GREENROOM_TRAINER_GID"]) == ("0", "0")
    # The trainer runs as its container's runAsUser where it sets one: so does the chown,
    # and the pvc init container that reclaims the trainer's files.
    own = manifests(sets=("securityContext.runAsUser=2000",))
    init = env_of(container(pod_spec(own), "prepare-offload-dir", init=True))
    assert (init["GREENROOM_TRAINER_UID"], init["GREENROOM_TRAINER_GID"]) == ("2000", "1000")
    pvc = container(
        pod_spec(manifests("pvc.yaml", sets=("securityContext.runAsUser=0", "securityContext.runAsNonRoot=false"))),
        "reclaim-offload-dir",
        init=True,
    )
    assert pvc["securityContext"]["runAsUser"] == 0 and pvc["securityContext"]["runAsNonRoot"] is False
    # Neither set: the image's user, 1000.
    unset = manifests(sets=("podSecurityContext.runAsUser=null", "podSecurityContext.runAsGroup=null"))
    init = env_of(container(pod_spec(unset), "prepare-offload-dir", init=True))
    assert (init["GREENROOM_TRAINER_UID"], init["GREENROOM_TRAINER_GID"]) == ("1000", "1000")


@pytest.mark.parametrize("mode", STORAGE_MODES)
def test_each_storage_mode_mounts_its_volume_and_no_root_outside_hostpath(mode):
    spec = pod_spec(manifests(STORAGE_MODES[mode]) if STORAGE_MODES[mode] else manifests())
    (vol,) = [v for v in spec["volumes"] if v["name"] == "offload"]
    (mount,) = [m for m in container(spec, "trainer")["volumeMounts"] if m["name"] == "offload"]
    assert mount["mountPath"] == "/var/lib/greenroom/offload"
    inits = spec.get("initContainers", [])
    if mode == "hostPath":
        assert vol["hostPath"] == {"path": "/mnt/nvme/greenroom", "type": "Directory"}
        assert mount["subPathExpr"] == "$(GREENROOM_POD_UID)"
        assert [c["name"] for c in inits] == ["prepare-offload-dir"]
        return
    assert "subPathExpr" not in mount
    for c in [*inits, *spec["containers"]]:
        sc = c.get("securityContext", {})
        assert sc.get("runAsUser", 1000) != 0 and "add" not in sc.get("capabilities", {}), c["name"]
    if mode == "emptyDir":
        assert vol == {"name": "offload", "emptyDir": {"sizeLimit": "500Gi"}}  # no medium: disk
        assert container(spec, "trainer")["resources"]["requests"]["ephemeral-storage"] == "500Gi"
        assert not inits
    elif mode == "ephemeral":
        claim = vol["ephemeral"]["volumeClaimTemplate"]["spec"]
        assert claim == {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "local-path",
            "resources": {"requests": {"storage": "300Gi"}},
        }
        assert not inits
    else:
        assert vol["persistentVolumeClaim"] == {"claimName": "nvme-scratch"}
        assert [c["name"] for c in inits] == ["reclaim-offload-dir"]


# Paths a user may give that plain `key: {{ value }}` YAML would turn into another path
# (a comment, a trimmed space, a flow mapping) or Kubernetes into another string ($(VAR)).
ODD_PATHS = ["/mnt/nvme #a", "/mnt/nvme ", "/p/'q\"", "/p/$(NNODES)/$$x/$HOME", "/p: x", "/p/{a}, [b]", "/p/*&!|>%@`"]


def k8s_expand(text: str, env: dict) -> str:
    """What Kubernetes makes of an env value or container arg: $(VAR) of a defined var
    replaced, $$ a literal $, anything else as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            out.append(env.get(text[i + 2 : end], text[i : end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@pytest.mark.parametrize("path", ODD_PATHS)
def test_a_path_with_yaml_or_shell_characters_is_the_same_path_everywhere(path, tmp_path):
    values = tmp_path / "odd.yaml"
    values.write_text(yaml.safe_dump({"storage": {"mountPath": "/var/lib" + path, "hostPath": {"path": path}}}))
    spec = pod_spec(manifests(str(values)))
    (vol,) = [v for v in spec["volumes"] if v["name"] == "offload"]
    assert vol["hostPath"]["path"] == path
    trainer = container(spec, "trainer")
    (mount,) = [m for m in trainer["volumeMounts"] if m["name"] == "offload"]
    assert mount["mountPath"] == "/var/lib" + path
    # The env and the command line say the path the volume is mounted at, after Kubernetes'
    # own $(VAR) expansion (env vars defined before each one).
    env = {e["name"]: e["value"] for e in trainer["env"] if "value" in e}
    assert k8s_expand(env["GREENROOM_DISK_DIR"], env) == "/var/lib" + path
    words = shlex.split(k8s_expand(env["GREENROOM_ARGS"], env))
    assert words[words.index("--offload-train-disk-dir") + 1] == "/var/lib" + path
    argv = [k8s_expand(a, env) for a in argv_of(trainer)]
    assert argv[argv.index("--offload-train-disk-dir") + 1] == "/var/lib" + path
    janitor = tmp_path / "janitor.yaml"
    janitor.write_text(yaml.safe_dump({"root": path}))
    (ds,) = by_kind(manifests(str(janitor), chart=JANITOR_CHART), "DaemonSet")
    assert ds["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"] == path


def test_every_name_and_string_value_reaches_its_field_as_written(tmp_path):
    odd = "x #y "
    values = tmp_path / "odd.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "image": {"repository": "reg.example.com/t #r", "tag": "1 #t", "pullPolicy": "Always"},
                "imagePullSecrets": [odd + "s"],
                "serviceAccountName": odd + "sa",
                "schedulerName": odd + "sch",
                "runtimeClassName": odd + "rc",
                "priorityClassName": odd + "pc",
                "shmSizeLimit": "8Gi #",
                "storage": {"mode": "ephemeral", "ephemeral": {"storageClassName": odd + "sc", "size": "9Gi #"}},
            }
        )
    )
    docs = manifests(str(values), chart=CHART)
    spec = pod_spec(docs)
    trainer = container(spec, "trainer")
    assert trainer["image"] == "reg.example.com/t #r:1 #t" and trainer["imagePullPolicy"] == "Always"
    assert spec["imagePullSecrets"] == [{"name": odd + "s"}]
    assert [spec[k] for k in ("serviceAccountName", "schedulerName", "runtimeClassName", "priorityClassName")] == [
        odd + "sa",
        odd + "sch",
        odd + "rc",
        odd + "pc",
    ]
    vols = {v["name"]: v for v in spec["volumes"]}
    claim = vols["offload"]["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == odd + "sc" and claim["resources"]["requests"]["storage"] == "9Gi #"
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == "8Gi #"
    pvc = pod_spec(manifests("pvc.yaml", sets=("storage.pvc.claimName=c #d",)))
    assert [v for v in pvc["volumes"] if v["name"] == "offload"][0]["persistentVolumeClaim"]["claimName"] == "c #d"
    named = manifests(sets=("nameOverride=n #o",))
    assert {d["metadata"]["labels"]["app.kubernetes.io/name"] for d in named} == {"n #o"}
    jvalues = tmp_path / "janitor.yaml"
    jvalues.write_text(
        yaml.safe_dump(
            {"image": {"repository": "reg #j"}, "priorityClassName": odd + "pc", "imagePullSecrets": [odd + "s"]}
        )
    )
    (ds,) = by_kind(manifests(str(jvalues), chart=JANITOR_CHART), "DaemonSet")
    jspec = ds["spec"]["template"]["spec"]
    assert jspec["containers"][0]["image"].startswith("reg #j:")
    assert jspec["priorityClassName"] == odd + "pc" and jspec["imagePullSecrets"] == [{"name": odd + "s"}]


def test_must_show_scheduling_hooks_land_on_the_right_objects():
    docs = manifests(
        sets=(
            "schedulerName=volcano",
            "runtimeClassName=nvidia",
            "priorityClassName=high",
            "jobLabels.kueue\\.x-k8s\\.io/queue-name=team-a",
        )
    )
    (job,) = by_kind(docs, "Job")
    # Kueue reads the queue from the Job object, not from its pod template.
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert "kueue.x-k8s.io/queue-name" not in job["spec"]["template"]["metadata"]["labels"]
    pod = job["spec"]["template"]["spec"]
    assert (pod["schedulerName"], pod["runtimeClassName"], pod["priorityClassName"]) == ("volcano", "nvidia", "high")
    (js,) = manifests("jobset.yaml", sets=("jobLabels.kueue\\.x-k8s\\.io/queue-name=team-a",))
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"


def test_every_other_scheduling_value_reaches_the_pod():
    docs = manifests("scheduling.yaml")
    (job,) = by_kind(docs, "Job")
    assert job["metadata"]["annotations"] == {"example.com/owner": "rl-team"}
    template = job["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "rl"
    assert template["metadata"]["annotations"]["example.com/trace"] == "on"
    assert template["metadata"]["annotations"]["greenroom.dev/pod-security-level"] == "privileged"
    spec = template["spec"]
    assert spec["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    trainer = container(spec, "trainer")
    assert trainer["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert trainer["resources"]["limits"]["hugepages-2Mi"] == trainer["resources"]["requests"]["hugepages-2Mi"] == "1Gi"
    assert {"name": "hugepages", "emptyDir": {"medium": "HugePages-2Mi"}} in spec["volumes"]
    assert {"name": "hugepages", "mountPath": "/dev/hugepages"} in trainer["volumeMounts"]
    assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in trainer["env"]
    other = pod_spec(manifests("disk-target.yaml"))
    assert other["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert other["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert other["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert {"name": "checkpoints", "mountPath": "/checkpoints"} in container(other, "trainer")["volumeMounts"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container(pod_spec(manifests("both.yaml")), "trainer")["env"]


def test_a_multi_node_job_places_one_pod_per_node_unless_affinity_is_given():
    anti = pod_spec(manifests("disk-target.yaml"))["affinity"]["podAntiAffinity"]
    (term,) = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "greenroom",
        "app.kubernetes.io/instance": "rel",
        "app.kubernetes.io/component": "trainer",
    }
    assert "affinity" not in pod_spec(manifests())  # one node
    assert "affinity" not in pod_spec(manifests("disk-target.yaml", sets=("onePodPerNode=false",)))
    assert "nodeAffinity" in pod_spec(manifests("both.yaml", sets=("nodes=2",)))["affinity"]


def test_jobset_variant_restarts_the_set_and_names_its_rendezvous_host():
    docs = manifests("jobset.yaml")
    assert sorted(d["kind"] for d in docs) == ["JobSet"]  # JobSet makes its own Service
    (js,) = docs
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 3}
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    (rj,) = js["spec"]["replicatedJobs"]
    assert rj["template"]["spec"]["completions"] == 4 and rj["template"]["spec"]["backoffLimitPerIndex"] == 3


@pytest.mark.parametrize("values", [None] + CI_VALUES)
def test_the_job_chart_has_no_cluster_scoped_objects(values):
    docs = manifests(values) if values else manifests()
    assert not {d["kind"] for d in docs} & {"ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"}


def test_notes_tell_how_to_follow_the_job_and_which_pod_security_level_it_needs():
    out = helm("install", "rel", CHART, "--dry-run=client", "--namespace", "train")
    assert out.returncode == 0, out.stderr
    assert "kubectl -n train get job rel-greenroom -w" in out.stdout
    assert "logs -f -l batch.kubernetes.io/job-name=rel-greenroom" in out.stdout
    assert 'Pod Security: these pods need the "privileged" level' in out.stdout
    out = helm(
        "install",
        "rel",
        CHART,
        "--dry-run=client",
        "--namespace",
        "train",
        "-f",
        os.path.join(CHART, "ci", "ephemeral.yaml"),
    )
    assert 'Pod Security: these pods need the "restricted" level' in out.stdout
    assert "MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NNODES, NODE_RANK, NPROC_PER_NODE and GREENROOM_ARGS" in out.stdout


def test_chart_readme_documents_every_value():
    assert not readme_lacks(
        CHART, ("resources", "podSecurityContext", "securityContext", "reclaim.initContainer.resources")
    )


def test_helm_package_leaves_the_ci_values_out(tmp_path):
    out = helm("package", CHART, "--destination", str(tmp_path))
    assert out.returncode == 0, out.stderr
    with tarfile.open(tmp_path / "greenroom-0.1.0.tgz") as tgz:
        names = tgz.getnames()
    assert "greenroom/values.schema.json" in names and "greenroom/README.md" in names
    assert not [n for n in names if n.startswith("greenroom/ci/")]


def test_torchrun_waits_at_the_rendezvous_for_a_bounded_time():
    # A rerun rank whose peers never come fails after this, instead of torchrun's 600 s.
    trainer = container(pod_spec(manifests(sets=("nodes=2",))), "trainer")
    assert "--rdzv-conf=timeout=300" in trainer["args"]
    assert trainer["args"].index("--rdzv-conf=timeout=300") < trainer["args"].index("--no-python")
    trainer = container(pod_spec(manifests(sets=("torchrun.rendezvousTimeoutSeconds=90",))), "trainer")
    assert "--rdzv-conf=timeout=90" in trainer["args"]
    job = by_kind(manifests(sets=("nodes=2",)), "Job")[0]["spec"]
    # A rank's reruns are bounded, and the Job fails once one rank has used them up.
    assert job["backoffLimitPerIndex"] == 3 and job["maxFailedIndexes"] == 0
