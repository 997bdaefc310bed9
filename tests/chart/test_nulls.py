"""A value set to null (`--set key=null`, or `key: null` in a -f file) deletes its key in
helm, so the chart's default vanishes and the manifests silently change (or carry `<nil>`).
Every key of each chart's values.yaml, sections and leaves (read from the file, so a new
value is covered without editing this test), is either refused by values.schema.json before
anything renders, with helm's message naming the key, or listed in NULL_DROPS below: null
then drops one field of the manifests, which render cleanly (no `<nil>`, no `%!`, no empty
value), and the chart's README says what null does there.

Helm 4 deletes a null key before the schema sees it (a `"type": "integer"` never sees the
null), so the schema refuses with `required` lists. A key whose default is null
(job.activeDeadlineSeconds, train.iterations) cannot be required: null is its default,
and it is in NULL_DROPS."""

import os
import re

import pytest
import yaml

from tests.chart.support import CHART, JANITOR_CHART, by_kind, container, helm, pod_spec, pod_template

pytestmark = pytest.mark.helm


def _job(docs):
    (job,) = by_kind(docs, "Job")
    return job


def _trainer(docs):
    return container(pod_spec(docs), "trainer")


def _init_resources(docs):
    return container(pod_spec(docs), "prepare-offload-dir", init=True).get("resources", {})


def _daemonset(docs):
    (ds,) = by_kind(docs, "DaemonSet")
    return ds["spec"]["template"]


def _janitor(docs):
    (c,) = _daemonset(docs)["spec"]["containers"]
    return c


def _names(items):
    return [i["name"] for i in items or []]


_EXTRA_VOLUME = {"extraVolumes": [{"name": "extra", "emptyDir": {}}]}

# key: (values that make the field appear, where to look for it, the field null drops).
MAIN_NULL_DROPS = {
    "imagePullSecrets": ({"imagePullSecrets": ["regcred"]}, pod_spec, "imagePullSecrets"),
    "job.maxFailedIndexes": ({}, lambda d: _job(d)["spec"], "maxFailedIndexes"),
    "job.ttlSecondsAfterFinished": ({}, lambda d: _job(d)["spec"], "ttlSecondsAfterFinished"),
    "job.activeDeadlineSeconds": (
        {"job": {"activeDeadlineSeconds": 3600}},
        lambda d: _job(d)["spec"],
        "activeDeadlineSeconds",
    ),
    "train.iterations": ({"train": {"iterations": 10}}, lambda d: _trainer(d)["args"], "--iterations"),
    "reclaim.initContainer.resources": (
        {},
        lambda d: container(pod_spec(d), "prepare-offload-dir", init=True),
        "resources",
    ),
    "reclaim.initContainer.resources.requests": ({}, _init_resources, "requests"),
    "reclaim.initContainer.resources.requests.cpu": ({}, lambda d: _init_resources(d)["requests"], "cpu"),
    "reclaim.initContainer.resources.requests.memory": ({}, lambda d: _init_resources(d)["requests"], "memory"),
    "reclaim.initContainer.resources.limits": ({}, _init_resources, "limits"),
    "reclaim.initContainer.resources.limits.cpu": ({}, lambda d: _init_resources(d)["limits"], "cpu"),
    "reclaim.initContainer.resources.limits.memory": ({}, lambda d: _init_resources(d)["limits"], "memory"),
    "resources": ({"resources": {"requests": {"cpu": "8"}}}, lambda d: _trainer(d)["resources"], "requests"),
    "schedulerName": ({"schedulerName": "volcano"}, pod_spec, "schedulerName"),
    "runtimeClassName": ({"runtimeClassName": "nvidia"}, pod_spec, "runtimeClassName"),
    "priorityClassName": ({"priorityClassName": "high"}, pod_spec, "priorityClassName"),
    "jobLabels": (
        {"jobLabels": {"kueue.x-k8s.io/queue-name": "a"}},
        lambda d: _job(d)["metadata"]["labels"],
        "kueue.x-k8s.io/queue-name",
    ),
    "jobAnnotations": (
        {"jobAnnotations": {"example.com/owner": "a"}},
        lambda d: _job(d)["metadata"].get("annotations", {}),
        "example.com/owner",
    ),
    "podLabels": ({"podLabels": {"team": "rl"}}, lambda d: pod_template(d)["metadata"]["labels"], "team"),
    "podAnnotations": (
        {"podAnnotations": {"example.com/trace": "on"}},
        lambda d: pod_template(d)["metadata"]["annotations"],
        "example.com/trace",
    ),
    "nodeSelector": ({"nodeSelector": {"gpu": "h100"}}, pod_spec, "nodeSelector"),
    "tolerations": ({"tolerations": [{"key": "gpu", "operator": "Exists"}]}, pod_spec, "tolerations"),
    "affinity": (
        {
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}
                    ]
                }
            }
        },
        pod_spec,
        "affinity",
    ),
    "topologySpreadConstraints": (
        {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]},
        pod_spec,
        "topologySpreadConstraints",
    ),
    "serviceAccountName": ({"serviceAccountName": "trainer"}, pod_spec, "serviceAccountName"),
    "extraEnv": ({"extraEnv": [{"name": "EXTRA", "value": "1"}]}, lambda d: _names(_trainer(d)["env"]), "EXTRA"),
    "extraVolumes": (_EXTRA_VOLUME, lambda d: _names(pod_spec(d)["volumes"]), "extra"),
    "extraVolumeMounts": (
        {**_EXTRA_VOLUME, "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}]},
        lambda d: _names(_trainer(d)["volumeMounts"]),
        "extra",
    ),
    "podSecurityContext.runAsNonRoot": ({}, lambda d: pod_spec(d)["securityContext"], "runAsNonRoot"),
    "podSecurityContext.runAsUser": ({}, lambda d: pod_spec(d)["securityContext"], "runAsUser"),
    "podSecurityContext.runAsGroup": ({}, lambda d: pod_spec(d)["securityContext"], "runAsGroup"),
    "podSecurityContext.fsGroup": ({}, lambda d: pod_spec(d)["securityContext"], "fsGroup"),
    "podSecurityContext.seccompProfile": ({}, lambda d: pod_spec(d)["securityContext"], "seccompProfile"),
    "securityContext.allowPrivilegeEscalation": (
        {},
        lambda d: _trainer(d)["securityContext"],
        "allowPrivilegeEscalation",
    ),
    "securityContext.capabilities": ({}, lambda d: _trainer(d)["securityContext"], "capabilities"),
    "securityContext.capabilities.drop": ({}, lambda d: _trainer(d)["securityContext"]["capabilities"], "drop"),
}

_METRICS = {"metricsService": {"enabled": True}}
_janitor_resources = {
    f"resources.{part}.{r}": ({}, lambda d, part=part: _janitor(d)["resources"][part], r)
    for part in ("requests", "limits")
    for r in ("cpu", "memory")
}
JANITOR_NULL_DROPS = {
    "imagePullSecrets": ({"imagePullSecrets": ["regcred"]}, lambda d: _daemonset(d)["spec"], "imagePullSecrets"),
    "metricsService.labels": (
        {"metricsService": {"enabled": True, "labels": {"team": "obs"}}},
        lambda d: by_kind(d, "Service")[0]["metadata"]["labels"],
        "team",
    ),
    "nodeSelector": ({"nodeSelector": {"gpu": "h100"}}, lambda d: _daemonset(d)["spec"], "nodeSelector"),
    "tolerations": (
        {"tolerations": [{"key": "gpu", "operator": "Exists"}]},
        lambda d: _daemonset(d)["spec"],
        "tolerations",
    ),
    "affinity": (
        {
            "affinity": {
                "nodeAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}
                    ]
                }
            }
        },
        lambda d: _daemonset(d)["spec"],
        "affinity",
    ),
    "priorityClassName": (
        {"priorityClassName": "system-node-critical"},
        lambda d: _daemonset(d)["spec"],
        "priorityClassName",
    ),
    "podLabels": ({"podLabels": {"team": "ops"}}, lambda d: _daemonset(d)["metadata"]["labels"], "team"),
    "podAnnotations": (
        {"podAnnotations": {"example.com/trace": "on"}},
        lambda d: _daemonset(d)["metadata"].get("annotations", {}),
        "example.com/trace",
    ),
    "resources": ({}, _janitor, "resources"),
    "resources.requests": ({}, lambda d: _janitor(d)["resources"], "requests"),
    "resources.limits": ({}, lambda d: _janitor(d)["resources"], "limits"),
    **_janitor_resources,
}

NULL_DROPS = {CHART: MAIN_NULL_DROPS, JANITOR_CHART: JANITOR_NULL_DROPS}


def _keys(chart):
    """Every key of values.yaml, dotted: sections (non-empty maps) and leaves."""
    with open(os.path.join(chart, "values.yaml"), encoding="utf-8") as f:
        values = yaml.safe_load(f)

    def walk(d, prefix=""):
        for k, v in d.items():
            yield prefix + k
            if isinstance(v, dict) and v:
                yield from walk(v, f"{prefix}{k}.")

    return list(walk(values))


def _nested(key, value):
    """{"a": {"b": value}} for "a.b"."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _template(chart, tmp_path, *values, sets=()):
    argv = ["template", "rel", chart, "--namespace", "train"]
    for i, v in enumerate(values):
        path = tmp_path / f"values{i}.yaml"
        path.write_text(yaml.safe_dump(v))
        argv += ["-f", str(path)]
    for s in sets:
        argv += ["--set", s]
    return helm(*argv)


def _blanks(node, path=""):
    """Where a rendered manifest holds a null, or an empty string in a list (a flag without
    its value)."""
    if node is None:
        return [path]
    if isinstance(node, dict):
        return [b for k, v in node.items() for b in _blanks(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [b for i, v in enumerate(node) for b in (_blanks(v, f"{path}[{i}]") if v != "" else [f"{path}[{i}]"])]
    return []


CASES = [
    pytest.param(chart, key, id=f"{os.path.basename(chart)}:{key}")
    for chart in (CHART, JANITOR_CHART)
    for key in _keys(chart)
]


@pytest.mark.parametrize("chart, key", CASES)
def test_null_is_refused_naming_the_key_or_drops_its_field(chart, key, tmp_path):
    allowed = NULL_DROPS[chart]
    if key not in allowed:
        *parents, leaf = key.split(".")
        named = f"at '{''.join('/' + p for p in parents)}': missing property '{leaf}'"
        for how in ({"values": (_nested(key, None),)}, {"sets": (f"{key}=null",)}):
            out = _template(chart, tmp_path, *how.get("values", ()), sets=how.get("sets", ()))
            assert out.returncode != 0, f"{key}: null accepted ({how}); refuse it in the schema or list it here"
            assert "values don't meet the specifications of the schema" in out.stderr, out.stderr
            assert named in out.stderr, out.stderr
        return
    present, where, field = allowed[key]
    before = _template(chart, tmp_path, present)
    assert before.returncode == 0, before.stderr
    before_docs = [d for d in yaml.safe_load_all(before.stdout) if d]
    assert field in where(before_docs), f"{key}: {field} not rendered"
    # The blanks the chart renders on purpose (RBAC's apiGroups [""], the core group).
    known = {b for d in before_docs for b in _blanks(d)}
    for how in ({"values": (present, _nested(key, None))}, {"values": (present,), "sets": (f"{key}=null",)}):
        out = _template(chart, tmp_path, *how["values"], sets=how.get("sets", ()))
        assert out.returncode == 0, out.stderr
        assert "<nil>" not in out.stdout and "%!" not in out.stdout, out.stdout
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        assert not {b for d in docs for b in _blanks(d)} - known, out.stdout
        assert field not in where(docs), f"{key}: null kept {field}"


@pytest.mark.parametrize("chart", [CHART, JANITOR_CHART], ids=os.path.basename)
def test_every_null_drop_is_a_value_its_readme_says_null_of(chart):
    """NULL_DROPS names keys of values.yaml only, and each one's README row (its own, or its
    section's where the README documents the section as one value) says what null does."""
    keys = _keys(chart)
    with open(os.path.join(chart, "README.md"), encoding="utf-8") as f:
        rows = dict(re.findall(r"^\| `([\w.]+)` \| `[^`]*` \| (.*) \|$", f.read(), re.M))
    silent = []
    for key in NULL_DROPS[chart]:
        assert key in keys, f"{key} is not a value of {chart}"
        parts = key.split(".")
        row = next(rows[k] for k in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if k in rows)
        if "null" not in row:
            silent.append(key)
    assert not silent, silent
