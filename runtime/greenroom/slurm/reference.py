"""The job YAML's keys as a Markdown table, read from their definition in
``greenroom.slurm.config``: each field's name, default, unit (``field`` metadata) and the
docstring under it. scripts/slurm-config-table.py writes it into docs/slurm.md, and a test
checks that the two agree, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re

from greenroom.slurm import config

# The sections of the YAML: (key prefix, dataclass).
SECTIONS = (("", config.SlurmJobConfig), ("train.", config.TrainArgs), ("container.", config.ContainerConfig))


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of ``cls`` (a string literal right after the
    annotated assignment, as the config classes write them)."""
    (node,) = [
        n for n in ast.parse(inspect.getsource(config)).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    ]
    docs = {}
    for stmt, following in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[stmt.target.id] = following.value.value
    return docs


def _yaml_value(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[]`" if not value else f"`{value}`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    if dataclasses.is_dataclass(value):
        return "see below"
    return f"`{value}`"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _yaml_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _yaml_value(f.default_factory())
    return "required"


def _markdown(doc: str) -> str:
    """A docstring as one table cell: reST ``literals`` as Markdown `code`, one line."""
    text = " ".join(doc.split()).replace("``", "`")
    return re.sub(r"\|", r"\\|", text)


def table() -> str:
    rows = ["| key | default | unit | meaning |", "|---|---|---|---|"]
    for prefix, cls in SECTIONS:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring"
            unit = f.metadata.get("unit", "")
            rows.append(f"| `{prefix}{f.name}` | {_default(f)} | {unit} | {_markdown(docs[f.name])} |")
    return "\n".join(rows)
