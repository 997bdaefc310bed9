"""Gang scheduling against the schedulers' own definitions: the PodGroups the chart renders
for Volcano and for the coscheduling plugin validate against those projects' CRDs, and the
real API server (scripts/services.d/k8s.sh) accepts them once the CRDs are applied, with
the pods naming their group; Kueue's Job is created suspended and starts no pod.

Where the CRDs come from (the Go module proxy, no registry for images here):
- Volcano: its CRDs are generated from its API types in volcano.sh/apis with controller-gen;
  the same is done here (volcano.sh/apis and sigs.k8s.io/controller-tools as modules; the
  result is cached under ~/.cache/greenroom).
- coscheduling: sigs.k8s.io/scheduler-plugins' module carries its CRD YAML.

What is not run: the schedulers themselves. Volcano's scheduler and controllers live in
volcano.sh/volcano, which the Go proxy here refuses (403); scheduler-plugins' scheduler
and Kueue's controller manager build against all of k8s.io/kubernetes, a second build of
tens of minutes on this 2-core machine beside the cluster's own, and Kueue needs its
webhook certificates. So these tests show what the schedulers are given, accepted by the
API server's validation of their CRDs; that Volcano or the plugin then places the pods as
a gang is their documented behaviour for a PodGroup with minMember, not exercised here.
"""

import json
import os
import shutil
import subprocess
import time

import jsonschema
import pytest
import yaml

from tests.chart.support import by_kind, manifests
from tests.k8s.support import install, kubectl, kubectl_json, namespace, require_cluster, trainer_values, wait_until

__all__ = ["namespace"]  # the fixture, imported for the tests below

VOLCANO_APIS = "volcano.sh/apis@v1.12.1"
CONTROLLER_TOOLS = "sigs.k8s.io/controller-tools@v0.16.5"
SCHEDULER_PLUGINS = "sigs.k8s.io/scheduler-plugins@v0.31.8"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "greenroom")
MULTI = ("nodes=4", "gpu.count=8", "procsPerNode=8")


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        pytest.skip("go not installed: the schedulers' CRDs come from their Go modules")
    return go


def _run(argv, cwd=None) -> str:
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env={**os.environ, "GOFLAGS": "-mod=mod"})
    if out.returncode != 0:
        pytest.skip(f"{' '.join(argv[:3])} failed (modules come from the Go proxy): {out.stderr[-400:]}")
    return out.stdout


def module_dir(module: str) -> str:
    return json.loads(_run([_go(), "mod", "download", "-json", module]))["Dir"]


@pytest.fixture(scope="module")
def volcano_crd() -> str:
    """Volcano's PodGroup CRD, generated from volcano.sh/apis as Volcano generates it."""
    out = os.path.join(CACHE, f"volcano-crds-{VOLCANO_APIS.split('@')[1]}")
    path = os.path.join(out, "scheduling.volcano.sh_podgroups.yaml")
    if os.path.exists(path):
        return path
    work = os.path.join(CACHE, "crd-gen")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "go.mod"), "w") as f:
        f.write("module crdgen\n\ngo 1.24\n")
    with open(os.path.join(work, "tools.go"), "w") as f:
        f.write(
            '//go:build tools\n\npackage tools\n\nimport (\n\t_ "sigs.k8s.io/controller-tools/cmd/controller-gen"\n'
            '\t_ "volcano.sh/apis/pkg/apis/scheduling/v1beta1"\n)\n'
        )
    go = _go()
    _run([go, "get", CONTROLLER_TOOLS.replace("@", "/cmd/controller-gen@"), VOLCANO_APIS], cwd=work)
    _run([go, "build", "-o", "controller-gen", "sigs.k8s.io/controller-tools/cmd/controller-gen"], cwd=work)
    tmp = f"{out}.tmp{os.getpid()}"
    _run(
        [
            os.path.join(work, "controller-gen"),
            "crd:allowDangerousTypes=true",
            "paths=volcano.sh/apis/pkg/apis/scheduling/v1beta1",
            f"output:crd:dir={tmp}",
        ],
        cwd=work,
    )
    os.replace(tmp, out)
    return path


@pytest.fixture(scope="module")
def coscheduling_crd() -> str:
    return os.path.join(module_dir(SCHEDULER_PLUGINS), "config", "crd", "bases", "scheduling.x-k8s.io_podgroups.yaml")


def crd_schema(path: str, api_version: str) -> dict:
    with open(path) as f:
        crd = yaml.safe_load(f)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


@pytest.mark.helm
@pytest.mark.parametrize("gang", ["volcano", "coscheduling"])
def test_rendered_podgroup_validates_against_the_schedulers_own_crd(gang, request):
    crd = request.getfixturevalue(f"{gang}_crd")
    sets = (
        (*MULTI, f"gang.scheduler={gang}", "schedulerName=scheduler-plugins-scheduler")
        if gang == "coscheduling"
        else (*MULTI, f"gang.scheduler={gang}")
    )
    (pg,) = by_kind(manifests(sets=sets), "PodGroup")
    schema = crd_schema(crd, pg["apiVersion"])
    jsonschema.validate(pg, schema)
    assert schema["properties"]["spec"]["properties"]["minMember"]["type"] == "integer"
    # The validator has teeth: a wrong type is refused.
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**pg, "spec": {**pg["spec"], "minMember": "four"}}, schema)


# -- the real API server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def applied_crds(volcano_crd, coscheduling_crd):
    """Both PodGroup CRDs applied to the test cluster (and removed after, where this module
    applied them)."""
    require_cluster("control-plane")
    made = []
    for path in (volcano_crd, coscheduling_crd):
        with open(path) as f:
            name = yaml.safe_load(f)["metadata"]["name"]
        if kubectl("get", "crd", name, check=False).returncode != 0:
            kubectl("apply", "--server-side", "-f", path)
            made.append(name)
        kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    yield
    for name in made:
        kubectl("delete", "crd", name, "--wait=false", check=False)


def gang_values(gang: str, **extra) -> dict:
    """A 2-pod CPU job (restricted: emptyDir) under ``gang``; its pods stay Pending where no
    scheduler of that name runs, which is all these tests need of them."""
    return trainer_values(2, "emptyDir", gang={"scheduler": gang, "queue": extra.pop("queue", "")}, **extra)


def _podgroup_and_pods(ns: str, resource: str) -> tuple[dict, list[dict]]:
    (pg,) = kubectl_json("-n", ns, "get", resource)["items"]
    pods = wait_until(
        "the Job's 2 pods",
        lambda: (lambda items: items if len(items) == 2 else None)(kubectl_json("-n", ns, "get", "pods")["items"]),
        ns=ns,
    )
    return pg, pods


@pytest.mark.k8s
def test_api_server_takes_volcanos_podgroup_and_the_pods_name_it(applied_crds, namespace):
    ns = namespace("restricted")
    install("gang", ns, gang_values("volcano"))
    pg, pods = _podgroup_and_pods(ns, "podgroups.scheduling.volcano.sh")
    assert pg["spec"]["minMember"] == 2 and pg["spec"]["queue"] == "default"
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == pg["metadata"]["name"]
    # The API server validates against the CRD's schema: a wrong type is refused there.
    bad = {
        "apiVersion": pg["apiVersion"],
        "kind": "PodGroup",
        "metadata": {"name": "bad", "namespace": ns},
        "spec": {"minMember": "two"},
    }
    out = kubectl("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert out.returncode != 0 and "minMember" in out.stderr, out.stderr


@pytest.mark.k8s
def test_api_server_takes_the_coscheduling_podgroup_and_the_pods_carry_its_label(applied_crds, namespace):
    ns = namespace("restricted")
    install("gang", ns, gang_values("coscheduling", schedulerName="scheduler-plugins-scheduler"))
    pg, pods = _podgroup_and_pods(ns, "podgroups.scheduling.x-k8s.io")
    assert pg["spec"]["minMember"] == 2
    for pod in pods:
        assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == pg["metadata"]["name"]


@pytest.mark.k8s
def test_kueue_job_is_created_suspended_and_starts_no_pod_before_admission(namespace):
    require_cluster("control-plane")
    ns = namespace("restricted")
    install("gang", ns, gang_values("kueue", queue="team-a"))
    (job,) = kubectl_json("-n", ns, "get", "jobs")["items"]
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    time.sleep(10)  # the Job controller would have made its pods by now, were it not suspended
    assert kubectl_json("-n", ns, "get", "pods")["items"] == []
    assert any(
        c["type"] == "Suspended" and c["status"] == "True"
        for c in kubectl_json("-n", ns, "get", "job", job["metadata"]["name"])["status"].get("conditions", [])
    )
