#!/usr/bin/env bash
# Writes the test cluster's certificates and kubeconfigs under DIR/pki (openssl, P-256 keys):
# a CA, the API server's serving cert, one client cert per component (the API server's
# Node and RBAC authorizers read their CN/O), and the service-account signing key pair.
# The second node's kubelet (scripts/k8s/node2.sh) gets its own cert and kubeconfig,
# kubelet-2: the Node authorizer lets each kubelet touch only its own node's objects.
# Usage: scripts/k8s/pki.sh DIR NODE_NAME NODE_IP SERVICE_IP SECOND_NODE_NAME
set -euo pipefail
[ "$#" -eq 5 ] || { echo "usage: scripts/k8s/pki.sh DIR NODE_NAME NODE_IP SERVICE_IP SECOND_NODE_NAME" >&2; exit 2; }
dir=$1 node=$2 node_ip=$3 service_ip=$4 node2=$5
pki="$dir/pki"
mkdir -p "$pki"
cd "$pki"

key() { openssl ecparam -name prime256v1 -genkey -noout -out "$1.key" 2>/dev/null; }

# cert NAME SUBJECT USAGE [SANS]: a leaf signed by the CA.
cert() {
  local name=$1 subject=$2 usage=$3 sans=${4:-}
  key "$name"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    [ -z "$sans" ] || echo "subjectAltName=$sans"
  } >"$name.ext"
  openssl req -new -key "$name.key" -subj "$subject" -out "$name.csr" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}

# kubeconfig NAME CERT: a kubeconfig that authenticates with CERT's client cert.
kubeconfig() {
  cat >"$dir/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: greenroom-test
  cluster:
    certificate-authority: $pki/ca.crt
    server: https://127.0.0.1:6443
users:
- name: $1
  user:
    client-certificate: $pki/$2.crt
    client-key: $pki/$2.key
contexts:
- name: $1@greenroom-test
  context: {cluster: greenroom-test, user: $1}
current-context: $1@greenroom-test
EOF
}

key ca
openssl req -x509 -new -key ca.key -subj "/CN=greenroom-test-ca" -days 3650 -out ca.crt 2>/dev/null
cert apiserver "/CN=kube-apiserver" serverAuth \
  "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$node_ip,IP:$service_ip"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth
cert admin "/O=system:masters/CN=greenroom-admin" clientAuth
cert controller-manager "/CN=system:kube-controller-manager" clientAuth
cert scheduler "/CN=system:kube-scheduler" clientAuth
cert kubelet "/O=system:nodes/CN=system:node:$node" serverAuth,clientAuth "DNS:$node,IP:$node_ip,IP:127.0.0.1"
cert kubelet-2 "/O=system:nodes/CN=system:node:$node2" serverAuth,clientAuth "DNS:$node2,IP:$node_ip,IP:127.0.0.1"
key service-account
openssl ec -in service-account.key -pubout -out service-account.pub 2>/dev/null

kubeconfig admin admin
kubeconfig controller-manager controller-manager
kubeconfig scheduler scheduler
kubeconfig kubelet kubelet
kubeconfig kubelet-2 kubelet-2
