"""Check one Python snippet of the docs in this fresh interpreter (tests/test_docs.py).

Every import runs (a module the machine lacks, other than greenroom's, is reported as
missing, not failed); every attribute chain rooted at an imported greenroom name
resolves (``greenroom.megatron.streaming`` after a bare ``import greenroom`` does not);
and a self-contained snippet (no free names, no ``...``, no CUDA) runs whole, in a
scratch dir. Prints one JSON object.

Usage: python tests/snippet_check.py FILE LINE  (the line of the opening fence)
"""

import ast
import builtins
import json
import os
import sys
import tempfile


def snippet(path: str, line: int) -> str:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    body = []
    for text in lines[line:]:
        if text.startswith("```"):
            break
        body.append(text)
    return "\n".join(body) + "\n"


def free_names(tree: ast.AST) -> set[str]:
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
            if isinstance(node, ast.FunctionDef):
                bound.update(a.arg for a in node.args.args + node.args.kwonlyargs)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return loaded - bound - set(dir(builtins))


def chains(tree: ast.AST):
    """``a.b.c`` attribute chains, outermost only."""
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts = []
            while isinstance(node, ast.Attribute):
                parts.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name):
                yield node.id, parts[::-1]


def main() -> int:
    path, line = sys.argv[1], int(sys.argv[2])
    code = snippet(path, line)
    result = {"where": f"{path}:{line}", "missing": [], "problems": [], "ran": False}
    tree = ast.parse(code, path)  # a SyntaxError fails the check
    namespace: dict = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                exec(compile(ast.Module([node], []), path, "exec"), namespace)
            except ModuleNotFoundError as e:
                if (e.name or "").startswith("greenroom"):
                    raise
                result["missing"].append(e.name)
    for root, attrs in chains(tree):
        value = namespace.get(root)
        if value is None or not getattr(value, "__name__", getattr(type(value), "__module__", "")).startswith(
            "greenroom"
        ):
            continue
        for attr in attrs:
            if not hasattr(value, attr):
                result["problems"].append(f"{root}.{'.'.join(attrs)}: {value!r} has no attribute {attr!r}")
                break
            value = getattr(value, attr)
    free = free_names(tree)
    runnable = not free and not result["missing"] and "..." not in code and "cuda" not in code
    result["free_names"] = sorted(free)
    if runnable and not result["problems"]:
        os.chdir(tempfile.mkdtemp(dir=os.environ.get("SNIPPET_DIR")))
        exec(compile(tree, path, "exec"), {"__name__": "__snippet__"})
        result["ran"] = True
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
