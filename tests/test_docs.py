"""The docs agree with the code: every Python snippet of README.md and docs/*.md compiles,
imports what it imports and names only greenroom attributes that exist; the
self-contained ones (the CPU examples) run; the README's flag table is the parser's; the
README's plan example prints its figures; every test the docs cite exists; each chart's
README lists every documented value of its values.yaml with its default."""

import glob
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def python_snippets():
    for path in DOCS:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if re.match(r"^```(python|py)\s*$", line):
                    yield os.path.relpath(path, REPO), number


SNIPPETS = list(python_snippets())
RUNS_MARK = "(tests/test_docs.py runs this)"


@pytest.mark.parametrize("where", [f"{p}:{n}" for p, n in SNIPPETS])
def test_snippet_compiles_imports_and_runs_where_it_can(where, tmp_path):
    path, line = where.rsplit(":", 1)
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(REPO, "runtime"),
        "SNIPPET_DIR": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "",
    }
    proc = subprocess.run(
        # -P: the checker's own dir (tests/, whose tests/megatron package would shadow
        # megatron-core) stays off sys.path, so a snippet imports what a user's script would.
        [sys.executable, "-P", os.path.join(REPO, "tests", "snippet_check.py"), path, line],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["problems"] == [], result
    # A snippet that says it runs must have run (the CPU examples).
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        marked = RUNS_MARK in "".join(f.readlines()[int(line) :]).split("```", 1)[0]
    assert result["ran"] or not marked, result
    if result["missing"]:
        pytest.skip(
            f"{where}: {', '.join(result['missing'])} not installed here; compiled and its greenroom names checked"
        )


def test_the_readme_flag_table_is_the_parsers():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "flag-table.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def _plain(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return " ".join(f.read().split())


def test_the_readme_plan_example_prints_what_the_readme_says(tmp_path):
    text = _plain("README.md")
    m = re.search(
        r"\(`(--params 744B [^`]*)`\), comes out at ([\d.]+) GB of optimizer state per rank: ([\d.]+) GB "
        r"of model state without streaming, which does not fit, and ([\d.]+) GB with it",
        text,
    )
    assert m, "README.md: the plan example's sentence moved; update this test"
    env = {k: v for k, v in os.environ.items() if k not in ("SCRATCH", "GREENROOM_DISK_DIR")}
    env["PYTHONPATH"] = os.path.join(REPO, "runtime")
    proc = subprocess.run(
        [sys.executable, "-m", "greenroom", "plan", *m.group(1).split(), "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rank = json.loads(proc.stdout)["per_rank"]
    said = [float(m.group(i)) for i in (2, 3, 4)]
    assert said == [
        round(rank["optimizer_state"] / 1e9, 1),
        round(rank["gpu"]["without_streaming"] / 1e9, 1),
        round(rank["gpu"]["with_streaming"] / 1e9, 1),
    ], said


# The docs a user reads, the record of faults and the benchmarks, and the deploy READMEs.
CITING = DOCS + sorted(
    glob.glob(os.path.join(REPO, "deploy", "*", "README.md"))
    + glob.glob(os.path.join(REPO, "deploy", "helm", "*", "README.md"))
)


def _test_names():
    """Each test module's path under tests/ (``optim/test_exact.py``), with its tests."""
    names = {}
    tests = os.path.join(REPO, "tests")
    for path in glob.glob(os.path.join(tests, "**", "test_*.py"), recursive=True):
        with open(path, encoding="utf-8") as f:
            names[os.path.relpath(path, tests)] = set(re.findall(r"^\s*(?:async )?def (test_\w+)", f.read(), re.M))
    return names


def test_every_test_the_docs_cite_exists():
    names = _test_names()
    every = set().union(*names.values())
    missing = []
    for path in CITING:
        text = open(path, encoding="utf-8").read()
        where = os.path.relpath(path, REPO)
        # `tests/dir/file.py::test_name[...]`, `tests/dir/file.py`, and `::test_name` after one of them.
        for m in re.finditer(r"tests/((?:\w+/)*test_\w+\.py)::(\w+)", text):
            if m.group(1) not in names:
                missing.append(f"{where}: {m.group(1)}")
            elif m.group(2) not in names[m.group(1)]:
                missing.append(f"{where}: {m.group(1)}::{m.group(2)}")
        for m in re.finditer(r"(?<![\w/.])tests/((?:\w+/)*test_\w+\.py)\b", text):
            if m.group(1) not in names:
                missing.append(f"{where}: {m.group(0)}")
        # A test file named without its folder is not a path a reader can open.
        for m in re.finditer(r"(?<![\w/.])(test_\w+\.py)\b", text):
            missing.append(f"{where}: {m.group(0)} (name it as tests/<folder>/{m.group(1)})")
        # A bare test name; one cut short with `...` names the tests that start with it.
        for m in re.finditer(r"(?<![\w:])(test_\w+)(\.\.\.)?(?![\w.*/])", text):
            name, prefix = m.group(1), m.group(2)
            if not (
                any(n.startswith(name) for n in every)
                if prefix
                else name in every or any(os.path.basename(k) == f"{name}.py" for k in names)
            ):
                missing.append(f"{where}: {name}")
    assert not missing, missing


def _documented_values(chart):
    """The keys of values.yaml that a `# --` comment documents, with their defaults as written."""
    keys, stack, documented = {}, [], False
    with open(os.path.join(chart, "values.yaml"), encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("#"):
                documented = documented or stripped.startswith("# --")
                continue
            m = re.match(r"^( *)([A-Za-z]\w*):(.*)$", line.rstrip("\n"))
            if m:
                stack = stack[: len(m.group(1)) // 2] + [m.group(2)]
                if documented:
                    keys[".".join(stack)] = m.group(3).split(" #")[0].strip()
            documented = False
    return keys


@pytest.mark.parametrize("chart", sorted(glob.glob(os.path.join(REPO, "deploy", "helm", "*", "values.yaml"))))
def test_the_chart_readme_lists_every_value_with_its_default(chart):
    chart = os.path.dirname(chart)
    values = _documented_values(chart)
    with open(os.path.join(chart, "README.md"), encoding="utf-8") as f:
        rows = dict(re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \| .* \|$", f.read(), re.M))
    assert sorted(rows) == sorted(values)
    wrong = {k: (values[k], rows[k]) for k in values if values[k] and rows[k] not in (values[k], "(see values.yaml)")}
    assert not wrong, wrong
