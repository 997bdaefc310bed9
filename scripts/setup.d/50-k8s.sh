#!/usr/bin/env bash
# Installs the Debian parts of the Kubernetes test cluster (scripts/services.d/k8s.sh):
# etcd, containerd, runc, the CNI plugins, and the tools kubelet and kube-proxy call.
# The Kubernetes programs themselves are built from Go modules (scripts/k8s/build.sh).
set -euo pipefail
# shellcheck source=scripts/lib/apt-install.sh
source "$(dirname "$0")/../lib/apt-install.sh"
apt_install 50-k8s "the Kubernetes cluster tests will skip" \
  etcd-server containerd runc containernetworking-plugins conntrack iptables iproute2 curl openssl \
  python3-yaml
