# greenroom: the two README commands are `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
BIN := $(VENV)/bin
# Where `make run` puts its per-rank files: the repo's own disk, never tmpfs.
RUN_DIR ?= $(CURDIR)/.run/offload
# One worker per core, each test file on one worker: a file's module fixtures (the image
# build, the Slurm jobs) run once and its tests never race each other.
PYTEST_ARGS ?= -n auto --dist loadfile -rsfE
IMAGE ?= greenroom
TAG ?= $(shell $(PYTHON) -c "import tomllib;print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])" 2>/dev/null || echo dev)
BASE_IMAGE ?= nvcr.io/nvidia/pytorch:25.09-py3

.PHONY: install run test lint system-deps image clean cluster cluster-down

install: $(VENV)/.installed

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

run: install
	$(BIN)/greenroom train --offload-train --offload-train-target disk \
	  --stream-optimizer-state-to-disk --offload-train-disk-dir "$(RUN_DIR)"

# System tools the tests use (Slurm, munge, podman/buildah/runc, helm). Installs
# them when run as root on Debian; otherwise the tests that need them skip with a reason.
system-deps:
	scripts/setup-system.sh

test: install system-deps lint
	PATH="$(CURDIR)/.tools/bin:$(CURDIR)/$(BIN):$$PATH" scripts/with-services.sh \
	  $(BIN)/python -m pytest $(PYTEST_ARGS)

# The code's own hygiene: formatting, lint, and the layer and no-cycle contracts of
# docs/architecture.md (pyproject.toml's [tool.ruff] and [tool.importlinter]).
lint: install
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	$(BIN)/lint-imports --no-cache

# A one-node Kubernetes cluster built from upstream (scripts/services.d/k8s.sh): the first
# run builds it (cached in ~/.cache/greenroom-k8s/); prints the KUBECONFIG to use.
cluster: system-deps
	GREENROOM_K8S_BUILD_TIMEOUT_S=0 scripts/services.d/k8s.sh start
	@scripts/services.d/k8s.sh env

cluster-down:
	scripts/services.d/k8s.sh stop

image:
	scripts/build-image.sh "$(IMAGE):$(TAG)" "$(BASE_IMAGE)"

clean:
	rm -rf $(VENV) .tools .run
