"""Rendering the Helm charts with the real helm binary, for the chart tests; and judging
rendered pods by the Pod Security Standards with Kubernetes' own checks (tests/chart/pss)."""

import hashlib
import json
import os
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import REPO, require_tool

CHART = os.path.join(REPO, "deploy", "helm", "greenroom")
JANITOR_CHART = os.path.join(REPO, "deploy", "helm", "greenroom-janitor")
CI_VALUES = sorted(f for f in os.listdir(os.path.join(CHART, "ci")) if f.endswith(".yaml"))
PSS_SOURCE = os.path.join(REPO, "tests", "chart", "pss")


def helm(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("helm"), *argv], capture_output=True, text=True)


def render(*values_files: str, sets: tuple[str, ...] = (), kube_version: str | None = None, chart: str = CHART) -> str:
    argv = ["template", "rel", chart, "--namespace", "train"]
    for f in values_files:
        argv += ["-f", os.path.join(chart, "ci", f)]
    for s in sets:
        argv += ["--set", s]
    if kube_version:
        argv += ["--kube-version", kube_version]
    out = helm(*argv)
    assert out.returncode == 0, out.stderr
    return out.stdout


def manifests(*values_files: str, sets: tuple[str, ...] = (), chart: str = CHART) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(*values_files, sets=sets, chart=chart)) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_template(docs: list[dict]) -> dict:
    """The trainer pod template, from the Job or from the JobSet's replicated job."""
    (job,) = by_kind(docs, "Job") or [r["template"] for r in by_kind(docs, "JobSet")[0]["spec"]["replicatedJobs"]]
    return job["spec"]["template"]


def pod_spec(docs: list[dict]) -> dict:
    """The trainer pod spec, from the Job or from the JobSet's replicated job."""
    return pod_template(docs)["spec"]


def container(spec: dict, name: str, init: bool = False) -> dict:
    (c,) = [c for c in spec["initContainers" if init else "containers"] if c["name"] == name]
    return c


def reject(*sets: str) -> str:
    """helm template's stderr for values that must be refused."""
    argv = ["template", "rel", CHART]
    for s in sets:
        argv += ["--set", s]
    out = helm(*argv)
    if out.returncode == 0:
        pytest.fail(f"helm template accepted {sets}")
    return out.stderr


def readme_lacks(chart: str, opaque: tuple[str, ...]) -> list[str]:
    """values.yaml keys (sections too, but not inside ``opaque`` ones) the README does not name."""
    readme = open(os.path.join(chart, "README.md"), encoding="utf-8").read()
    values = yaml.safe_load(open(os.path.join(chart, "values.yaml"), encoding="utf-8"))

    def keys(d, prefix=""):
        for k, v in d.items():
            path = f"{prefix}{k}"
            yield path
            if isinstance(v, dict) and v and path not in opaque:
                yield from keys(v, path + ".")

    return [k for k in keys(values) if f"`{k}`" not in readme]


def pss_check_binary() -> str:
    """tests/chart/pss built once per source version (cached outside the checkout), or a skip
    saying why it cannot be built."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("go not installed: the Pod Security check (tests/chart/pss) is built with it")
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        with open(os.path.join(PSS_SOURCE, name), "rb") as f:
            digest.update(f.read())
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "greenroom")
    binary = os.path.join(cache, f"pss-check-{digest.hexdigest()[:16]}")
    if not os.path.exists(binary):
        os.makedirs(cache, exist_ok=True)
        tmp = f"{binary}.tmp{os.getpid()}"
        out = subprocess.run(
            [go, "build", "-o", tmp, "."],
            cwd=PSS_SOURCE,
            capture_output=True,
            text=True,
            env={**os.environ, "GOFLAGS": "-mod=mod"},
        )
        if out.returncode != 0:
            pytest.skip(f"tests/chart/pss did not build (its modules come from the Go proxy): {out.stderr[-500:]}")
        os.replace(tmp, binary)
    return binary


def pod_security(templates: dict[str, dict], level: str) -> dict[str, list[str]]:
    """Each pod template's violations of the Pod Security Standards ``level`` (baseline or
    restricted), by name, from Kubernetes' own checks; an empty list: allowed."""
    requests = [{"name": name, "level": level, "template": t} for name, t in templates.items()]
    out = subprocess.run([pss_check_binary()], input=json.dumps(requests), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {v["name"]: v["violations"] for v in json.loads(out.stdout)}
