"""Stages the wheels an offline build of images/Dockerfile installs (GREENROOM_IMAGE_WHEELS
with GREENROOM_PIP_NO_INDEX=1): torch, its CUDA runtime wheels (nvidia-*, cuda-toolkit,
cuda-bindings, triton), torch-memory-saver, megatron-core and every dependency of greenroom,
each at the version installed in this Python, for this Python's platform.

PyPI's torch 2.13.0 is the CUDA build: it imports only with its nvidia-* libraries
(libtorch_global_deps.so links them), and pip inside the build resolves them from torch's
metadata even for a torch already installed. So the whole closure is staged, extras
followed (torch asks for cuda-toolkit[cublas,...]). On a machine without a GPU that torch
imports and torch.cuda.is_available() is False.

Each wheel is downloaded once with --no-deps into DIR; file names carry the versions, so
one DIR serves every version set. A stamp of the staged list skips pip (which asks the
index about every name even when its file is there) when nothing changed.
Usage: python images/stage_wheels.py DIR
"""

import importlib.metadata as md
import os
import re
import subprocess
import sys

import tomllib
from packaging.requirements import Requirement

ROOTS = ["greenroom", "torch", "megatron-core", "torch-memory-saver"]
PYPROJECT = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")


def fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, str]:
    """name -> installed version of every distribution the roots need here, extras followed."""
    extras_seen: dict[str, set[str]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(root, frozenset()) for root in roots]
    while todo:
        name, extras = todo.pop()
        name = norm(name)
        known = extras_seen.get(name)
        if known is not None and extras <= known:
            continue
        extras_seen[name] = (known or set()) | extras
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            fail(f"stage_wheels: {name} (the image needs it) is not installed in {sys.executable}: run make install")
        for spec in requires:
            req = Requirement(spec)
            wanted = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *extras})
            if wanted:
                todo.append((req.name, frozenset(req.extras)))
    return {name: md.version(name) for name in extras_seen}


def main() -> None:
    if len(sys.argv) != 2:
        fail("usage: python images/stage_wheels.py DIR")
    dest = sys.argv[1]
    pins = closure(ROOTS)
    del pins["greenroom"]  # built from the source tree by the image build
    with open(PYPROJECT, "rb") as f:
        build_requires = tomllib.load(f)["build-system"]["requires"]
    for spec in build_requires:  # the build backend at the version the build asks for
        pins.pop(norm(Requirement(spec).name), None)
    wanted = sorted(f"{n}=={v}" for n, v in pins.items()) + build_requires
    os.makedirs(dest, exist_ok=True)
    stamp = os.path.join(dest, ".staged")
    if os.path.exists(stamp) and open(stamp).read().split("\n") == wanted:
        return
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", dest]
    subprocess.run(argv + wanted, check=True)
    with open(stamp, "w") as f:
        f.write("\n".join(wanted))


if __name__ == "__main__":
    main()
