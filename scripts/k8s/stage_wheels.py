"""Stages the wheels of the test cluster's greenroom image (scripts/k8s/image.sh).

Every distribution greenroom and the image's megatron-core and torch-memory-saver need, at
the versions installed in this Python, each downloaded with --no-deps; except torch and
its CUDA libraries. PyPI's torch 2.13.0 is the CUDA build and does not import without its
nvidia-* libraries (libtorch_global_deps.so links them): about 3 GB that every pod start
would unpack. The pods take torch from the node's Python instead (a read-only hostPath,
see tests/test_k8s_pods.py); the image carries the rest.
Usage: python scripts/k8s/stage_wheels.py DIR
"""

import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement

# torch and its CUDA runtime: the node's (see above).
FROM_NODE = re.compile(r"^(torch$|nvidia-|triton$|cuda-)")
ROOTS = ["greenroom", "megatron-core", "torch-memory-saver"]
PYPROJECT = os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version of every distribution the roots need here (no extras)."""
    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = norm(todo.pop())
        if name in seen or FROM_NODE.match(name):
            continue
        seen[name] = md.version(name)
        for spec in md.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def main() -> None:
    dest = sys.argv[1]
    pins = closure(ROOTS)
    del pins["greenroom"]  # built from the source tree by the image build
    with open(PYPROJECT, "rb") as f:
        build_requires = tomllib.load(f)["build-system"]["requires"]
    for spec in build_requires:  # the build backend at the version the build asks for
        pins.pop(norm(Requirement(spec).name), None)
    wanted = sorted(f"{n}=={v}" for n, v in pins.items()) + build_requires
    # pip asks the index about every name even when its wheel is here: a stamp of the
    # list staged last skips that on a warm cache.
    stamp = os.path.join(dest, ".staged")
    if os.path.exists(stamp) and open(stamp).read().split() == wanted:
        return
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", dest]
    subprocess.run(argv + wanted, check=True)
    with open(stamp, "w") as f:
        f.write("\n".join(wanted))


if __name__ == "__main__":
    main()
