#!/usr/bin/env bash
# A two-node Kubernetes cluster on this machine for the chart tests, from upstream parts
# built by scripts/k8s/build.sh (cached in ~/.cache/greenroom-k8s/):
#   control plane: etcd, kube-apiserver (RBAC, Node authorizer, Pod Security admission,
#   service-account tokens), kube-controller-manager, kube-scheduler;
#   node (scripts/k8s/node.sh): containerd + runc + CNI bridge, kubelet; a second node
#   (scripts/k8s/node2.sh), tainted, for the multi-node tests; kube-proxy as a
#   DaemonSet (scripts/k8s/proxy.sh); cluster DNS (scripts/k8s/dns.sh): CoreDNS as a
#   Deployment; both in kube-system with their own ServiceAccounts; the JobSet controller
#   (scripts/k8s/jobset.sh) as upstream deploys it, in jobset-system.
#   start: builds what is not cached, writes certs and configs under .run/k8s/, starts the
#          daemons and waits until the API server is ready (and the nodes, where they run)
#   stop:  kills the daemons this script started (by PID), removes .run/k8s/ and the
#          iptables chains its kubelet and kube-proxy made
#   env:   prints `export KUBECONFIG=...`
# What could not start is written to .run/k8s/status (`part: reason`): the tests read it
# and skip with that reason. Clients use KUBECONFIG=<repo>/.run/k8s/admin.kubeconfig.
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
dir="${GREENROOM_K8S_DIR:-$repo/.run/k8s}"
node_name=greenroom-node
node2_name=greenroom-node2
service_cidr=10.96.0.0/16
service_ip=10.96.0.1   # the `kubernetes` Service: the first address of service_cidr
export PATH="$repo/.tools/bin:$PATH"
# shellcheck source=scripts/k8s/node.sh
source scripts/k8s/node.sh
# shellcheck source=scripts/k8s/node2.sh
source scripts/k8s/node2.sh
# shellcheck source=scripts/k8s/jobset.sh
source scripts/k8s/jobset.sh
# shellcheck source=scripts/k8s/dns.sh
source scripts/k8s/dns.sh
# shellcheck source=scripts/k8s/proxy.sh
source scripts/k8s/proxy.sh

say() { echo "services/k8s: $*"; }
status() { echo "$1: $2" >>"$dir/status"; say "$1: $2"; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# daemon NAME PROGRAM ARGS...: start PROGRAM in its own session, log and pid under $dir.
daemon() {
  local name=$1; shift
  alive "$dir/$name.pid" && return 0
  setsid "$@" >"$dir/log/$name.log" 2>&1 </dev/null &
  echo $! >"$dir/$name.pid"
}

# wait_for WHAT SECONDS COMMAND...: poll COMMAND until it succeeds.
wait_for() {
  local what=$1 limit=$2 i; shift 2
  for ((i = 0; i < limit * 2; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  say "$what did not come up in ${limit}s"
  return 1
}

node_ip() { ip -4 route get 1.1.1.1 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "src") print $(i + 1)}'; }

kubectl_admin() { kubectl --kubeconfig "$dir/admin.kubeconfig" "$@"; }

# newest_warning NAMESPACE: NAMESPACE's newest Warning event (`object: reason: message`):
# why a pod never started (its sandbox's network not set up, no room for its snapshot),
# which its logs cannot say.
newest_warning() {
  local event
  event=$(kubectl_admin -n "$1" get events --field-selector type=Warning --sort-by=.lastTimestamp \
    -o jsonpath='{range .items[*]}{.involvedObject.name}: {.reason}: {.message}{"\n"}{end}' 2>&1 | tail -1)
  echo "${event:-none}"
}

# why_not_ready NAMESPACE WORKLOAD: the last line of WORKLOAD's logs and NAMESPACE's newest
# Warning event.
why_not_ready() {
  echo "$(kubectl_admin -n "$1" logs "$2" --tail=1 2>&1 | tail -1); newest Warning event: $(newest_warning "$1")"
}

start_control_plane() {
  local bin=$1 ip=$2 etcd
  etcd=$(command -v etcd || echo /usr/bin/etcd)
  daemon etcd "$etcd" --name greenroom --data-dir "$dir/etcd" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster greenroom=http://127.0.0.1:2380 --listen-metrics-urls http://127.0.0.1:2381
  wait_for etcd 30 curl -fsS http://127.0.0.1:2381/health
  local pki="$dir/pki"
  # Admission: the API server's default plugins, Pod Security among them (namespaces pick
  # their level by label), plus NodeRestriction. Authorization: Node for the kubelet, RBAC.
  daemon kube-apiserver "$bin/kube-apiserver" \
    --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 --advertise-address="$ip" \
    --secure-port=6443 --service-cluster-ip-range="$service_cidr" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" --authorization-mode=Node,RBAC \
    --enable-admission-plugins=NodeRestriction --allow-privileged=true \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/service-account.pub" \
    --service-account-signing-key-file="$pki/service-account.key" \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP,Hostname
  wait_for kube-apiserver 120 kubectl_admin get --raw /readyz
  daemon kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig="$dir/controller-manager.kubeconfig" --leader-elect=false \
    --service-account-private-key-file="$pki/service-account.key" --root-ca-file="$pki/ca.crt" \
    --use-service-account-credentials=true --service-cluster-ip-range="$service_cidr" \
    --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
    --bind-address=127.0.0.1
  daemon kube-scheduler "$bin/kube-scheduler" --kubeconfig="$dir/scheduler.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1
  # The controller manager's service-account controller makes `default` in each namespace.
  wait_for kube-controller-manager 60 kubectl_admin -n default get serviceaccount default
  # Node-local volumes for the chart's ephemeral and pvc modes: static local PVs (the tests
  # make them), bound when a pod is scheduled.
  kubectl_admin apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: greenroom-local}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
EOF
  status control-plane "up ($(basename "$(dirname "$bin")"))"
}

start() {
  if [ "$(id -u)" -ne 0 ]; then say "not root, not starting (the Kubernetes tests will skip)"; return 0; fi
  if [ -s "$dir/kube-apiserver.pid" ] && alive "$dir/kube-apiserver.pid"; then
    say "already running (KUBECONFIG=$dir/admin.kubeconfig)"; return 0
  fi
  mkdir -p "$dir/log"
  : >"$dir/status"
  for tool in kubectl openssl curl; do
    command -v "$tool" >/dev/null || { status control-plane "$tool not installed"; return 0; }
  done
  command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || { status control-plane "etcd not installed (Debian etcd-server)"; return 0; }
  if ss -Hltn 'sport = :6443' | grep -q .; then
    status control-plane "port 6443 is taken (another cluster on this machine?): not starting"; return 0
  fi
  # make test bounds a cold build (CI pays it on a new machine within its own limit): past
  # the budget the build stops, the Kubernetes tests skip saying so, and the next start
  # resumes from Go's build cache. 0 = no bound (make cluster).
  local bin budget=${GREENROOM_K8S_BUILD_TIMEOUT_S:-1800} rc=0
  bin=$(timeout "$budget" scripts/k8s/build.sh | tail -1) || rc=$?
  if [ "$rc" -eq 124 ]; then
    status control-plane "the cold build of the Kubernetes components did not finish within ${budget} s (GREENROOM_K8S_BUILD_TIMEOUT_S); the next start resumes it from Go's build cache"
    return 0
  elif [ "$rc" -ne 0 ]; then
    status control-plane "scripts/k8s/build.sh failed (see its output above)"; return 0
  fi
  ln -sfn "$bin" "$dir/bin"
  local ip
  ip=$(node_ip)
  [ -s "$dir/pki/ca.crt" ] || scripts/k8s/pki.sh "$dir" "$node_name" "$ip" "$service_ip" "$node2_name"
  start_control_plane "$bin" "$ip" || { status control-plane "failed to start (logs: $dir/log)"; return 0; }
  start_node "$bin" "$ip" || status node "failed to start (logs: $dir/log)"
  if grep -q "^node: up" "$dir/status"; then
    # Side by side: the greenroom image's import into each node's containerd (after a change
    # to the image's sources, one build and then GBs into each: minutes on a 2-core machine),
    # the second node's start, and the JobSet controller and CoreDNS on the first node
    # (each waits seconds for its probes); none needs another. The two imports share one
    # build (images/ci-image.sh holds a lock around it; images/ci-base.sh one around the
    # base every image here is built on).
    local image_pid node2_pid jobset_applied=0
    import_node_image &
    image_pid=$!
    { start_node2 "$bin" "$ip" || status node2 "failed to start (logs: $dir/log)"; } &
    node2_pid=$!
    apply_jobset "$bin" && jobset_applied=1
    start_dns "$bin" || status dns "failed to start (kubectl -n kube-system logs deployment/coredns)"
    [ "$jobset_applied" = 0 ] || wait_jobset ||
      status jobset "failed to start (kubectl -n jobset-system logs deployment/jobset-controller-manager)"
    wait "$image_pid" "$node2_pid" || true
    # Last: it tells whether a pod can start with everything else imported and running.
    probe_pods
  else
    status pods "not started: the node is not up"
    status dns "not started: the node is not up"
    status jobset "not started: the node is not up"
    status node2 "not started: the first node is not up"
  fi
  say "KUBECONFIG=$dir/admin.kubeconfig"
}

kill_daemon() {
  local pid
  [ -s "$dir/$1.pid" ] || return 0
  pid=$(cat "$dir/$1.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/$1.pid"
}

stop() {
  [ -d "$dir" ] || return 0
  local name kubelet_ran=0
  # Controllers first (nothing recreates the pods), then the node's pods, then the rest.
  for name in kube-controller-manager kube-scheduler; do kill_daemon "$name"; done
  [ ! -d "$dir/bin" ] || drain_node "$dir/bin"
  stop_node2_tasks
  [ ! -s "$dir/kubelet.pid" ] || kubelet_ran=1
  for name in kubelet kubelet-2 containerd containerd-2 kube-apiserver etcd; do kill_daemon "$name"; done
  [ "$kubelet_ran" = 0 ] || remove_kubelet_chains
  remove_node2_leftovers
  unmount_all
  rm -rf "$dir"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) echo "export KUBECONFIG=$dir/admin.kubeconfig" ;;
  *) echo "usage: scripts/services.d/k8s.sh start|stop|env" >&2; exit 2 ;;
esac
