"""Rendering the Helm chart with the real helm binary, for the chart tests."""

import os
import subprocess

import pytest
import yaml

from tests.conftest import REPO, require_tool

CHART = os.path.join(REPO, "deploy", "helm", "greenroom")
CI_VALUES = sorted(f for f in os.listdir(os.path.join(CHART, "ci")) if f.endswith(".yaml"))


def helm(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_tool("helm"), *argv], capture_output=True, text=True)


def render(*values_files: str, sets: tuple[str, ...] = (), kube_version: str | None = None) -> str:
    argv = ["template", "rel", CHART, "--namespace", "train"]
    for f in values_files:
        argv += ["-f", os.path.join(CHART, "ci", f)]
    for s in sets:
        argv += ["--set", s]
    if kube_version:
        argv += ["--kube-version", kube_version]
    out = helm(*argv)
    assert out.returncode == 0, out.stderr
    return out.stdout


def manifests(*values_files: str, sets: tuple[str, ...] = ()) -> list[dict]:
    return [d for d in yaml.safe_load_all(render(*values_files, sets=sets)) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_spec(docs: list[dict]) -> dict:
    """The trainer pod spec, from the Job or from the JobSet's replicated job."""
    (job,) = by_kind(docs, "Job") or [r["template"] for r in by_kind(docs, "JobSet")[0]["spec"]["replicatedJobs"]]
    return job["spec"]["template"]["spec"]


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
