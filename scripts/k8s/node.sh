# shellcheck shell=bash disable=SC2154  # dir, node_name: set by scripts/services.d/k8s.sh
# The test cluster's node, sourced by scripts/services.d/k8s.sh (its helpers: daemon,
# wait_for, status, newest_warning, kubectl_admin; its variables: dir, node_name, service_cidr; dns_ip
# from scripts/k8s/dns.sh):
# containerd (runc, CNI bridge) with a locally built pause image and the kubelet as host
# processes; kube-proxy (scripts/k8s/proxy.sh) and cluster DNS (scripts/k8s/dns.sh) in pods.

pod_cidr=10.244.0.0/16
pause_image=localhost/greenroom-pause:1
# containerd's image store outlives the cluster (the greenroom image is GBs to import);
# its state (tasks, sockets) lives and dies with the cluster under $dir.
containerd_root="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}/containerd"

# write_node_configs BIN IP [NODE_DIR CONTAINERD_ROOT BRIDGE SUBNET KUBELET_CERT]: containerd's,
# the CNI bridge's and the kubelet's configs of a node under NODE_DIR (default: the first
# node's, in $dir; scripts/k8s/node2.sh writes the second's).
write_node_configs() {
  local bin=$1 ip=$2 nd=${3:-$dir} root=${4:-$containerd_root} bridge=${5:-greenroom0} subnet=${6:-$pod_cidr}
  local cert=${7:-kubelet}
  mkdir -p "$nd/containerd" "$nd/cni/net.d" "$nd/kubelet"
  cat >"$nd/containerd/config.toml" <<EOF
version = 2
root = "$root"
state = "$nd/containerd/state"
[grpc]
  address = "$nd/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  # These machines refuse lowering oom_score_adj (the kubelet asks -998 for sandboxes; runc
  # then fails with "can't get final child's PID from pipe: EOF"): never below containerd's own.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$nd/cni/net.d"
EOF
  cat >"$nd/cni/net.d/10-greenroom.conflist" <<EOF
{"cniVersion": "1.0.0", "name": "greenroom-test", "plugins": [
  {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$subnet"}]], "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": "$nd/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}
EOF
  # Eviction thresholds near zero: a CI disk that is 90% full must not evict the tests' pods.
  cat >"$nd/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $dir/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $dir/pki/$cert.crt
tlsPrivateKeyFile: $dir/pki/$cert.key
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$nd/containerd/containerd.sock
clusterDNS: [$dns_ip]
clusterDomain: cluster.local
failSwapOn: false
failCgroupV1: false
address: $ip
healthzBindAddress: 127.0.0.1
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
EOF
}

# The pause image, made from the locally built pause program (no registry to pull from),
# in the containerd at SOCKET (default: the first node's).
import_pause_image() {
  local bin=$1 ctr=(ctr --address "${2:-$dir/containerd/containerd.sock}" --namespace k8s.io)
  "${ctr[@]}" images check "name==$pause_image" 2>/dev/null | grep -q "$pause_image" && return 0
  local work
  work=$(mktemp -d)
  mkdir "$work/rootfs"
  cp "$bin/pause" "$work/rootfs/pause"
  tar -C "$work/rootfs" -c . | podman --storage-driver vfs import -q --change 'ENTRYPOINT ["/pause"]' - "$pause_image" >/dev/null
  podman --storage-driver vfs save -q --format docker-archive -o "$work/pause.tar" "$pause_image"
  "${ctr[@]}" images import "$work/pause.tar" >/dev/null
  rm -rf "$work"
}

# program_image REPOSITORY PROGRAM [CONTAINERFILE-LINE...]: an image of a program built
# here, on the CI base (the programs link glibc), imported into containerd unless it has it
# already (no registry is reachable); prints its name. The tag hashes the program and the
# lines; the repository's other tags are removed.
program_image() {
  local repository=$1 program=$2 image ctx ctr=(ctr --address "$dir/containerd/containerd.sock" --namespace k8s.io)
  shift 2
  image=$repository:$( (sha256sum <"$program"; printf '%s\n' "$@") | sha256sum | cut -c1-12)
  if ! "${ctr[@]}" images ls -q "name==$image" | grep -q .; then
    bash images/ci-base.sh >&2
    ctx=$(mktemp -d)
    cp "$program" "$ctx/"
    printf '%s\n' "FROM localhost/greenroom-ci-base:bookworm-2" "$@" "COPY $(basename "$program") /" >"$ctx/Containerfile"
    STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot BUILDAH_LAYERS=false podman build -q -t "$image" "$ctx" >/dev/null
    rm -rf "$ctx"
    STORAGE_DRIVER=vfs podman save --format docker-archive "$image" | "${ctr[@]}" images import - >/dev/null
    STORAGE_DRIVER=vfs podman rmi -f "$image" >/dev/null
    scripts/k8s/prune-images.sh "$dir/containerd/containerd.sock" "$image" "$repository:"
  fi
  echo "$image"
}

# Containers an earlier cluster left in the kept image store (their tasks died with it), of
# the containerd at SOCKET.
remove_stale_containers() {
  local ctr=(ctr --address "$1" --namespace k8s.io) ids
  mapfile -t ids < <("${ctr[@]}" containers ls -q)
  ((${#ids[@]} == 0)) || "${ctr[@]}" containers rm "${ids[@]}" >/dev/null 2>&1 || true
}

node_ready() {
  kubectl_admin get node "$node_name" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True
}

start_node() {
  local bin=$1 ip=$2 missing=()
  for tool in containerd ctr runc podman iptables conntrack; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
  if ((${#missing[@]})); then status node "not started: ${missing[*]} not installed"; return 0; fi
  write_node_configs "$bin" "$ip"
  # Pods reach ClusterIPs through kube-proxy's iptables rules on the bridge.
  modprobe br_netfilter 2>/dev/null || true
  sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 2>/dev/null || true
  daemon containerd containerd --config "$dir/containerd/config.toml"
  wait_for containerd 30 ctr --address "$dir/containerd/containerd.sock" version || {
    status node "containerd did not start: $(tail -1 "$dir/log/containerd.log")"; return 0; }
  remove_stale_containers "$dir/containerd/containerd.sock"
  import_pause_image "$bin" || { status node "the pause image could not be imported into containerd"; return 0; }
  daemon kubelet "$bin/kubelet" --config="$dir/kubelet/config.yaml" --kubeconfig="$dir/kubelet.kubeconfig" \
    --root-dir="$dir/kubelet/root" --hostname-override="$node_name" --node-ip="$ip"
  if ! wait_for "node $node_name" 90 node_ready; then
    status node "the kubelet did not make $node_name Ready: $(grep -E '^E[0-9]{4}' "$dir/log/kubelet.log" | tail -1)"
    return 0
  fi
  start_proxy "$bin" "$ip" || return 0
  status node "up ($node_name Ready, kube-proxy running)"
}

# import_node_image: the greenroom image into the first node's containerd (built first
# where podman lacks its tag; scripts/k8s/image.sh).
import_node_image() {
  local image
  if image=$(scripts/k8s/image.sh "$dir/containerd/containerd.sock" | tail -1); then
    echo "$image" >"$dir/image"
    status image "up ($image in containerd)"
  else
    status image "${image:-scripts/k8s/image.sh failed (see its output above)}"
  fi
}

# probe_pods: a pod on the first node's bridge (the pause image, nothing mounted, in
# kube-system) must reach Running. The chart's pods need what it needs (a sandbox whose
# network the CNI bridge sets up, a snapshot, runc); where it cannot run, their tests skip
# saying why (its newest Warning event) instead of each waiting out its bound.
probe_pods() {
  local probe=greenroom-probe
  kubectl_admin -n kube-system delete pod "$probe" --ignore-not-found >/dev/null 2>&1 || true
  kubectl_admin -n kube-system apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $probe}
spec:
  nodeName: $node_name
  automountServiceAccountToken: false
  securityContext: {runAsNonRoot: true, runAsUser: 65534, seccompProfile: {type: RuntimeDefault}}
  containers:
  - name: pause
    image: $pause_image
    imagePullPolicy: Never
    securityContext: {allowPrivilegeEscalation: false, capabilities: {drop: [ALL]}}
EOF
  if kubectl_admin -n kube-system wait "pod/$probe" --for=jsonpath='{.status.phase}'=Running --timeout=120s >/dev/null 2>&1; then
    status pods "up (a pod on $node_name's bridge ran)"
  else
    status pods "a pod on $node_name's bridge did not start within 120 s: $(newest_warning kube-system)"
  fi
  kubectl_admin -n kube-system delete pod "$probe" --wait=false >/dev/null 2>&1 || true
}

# Stops the node's pods the way the kubelet does (sandboxes, their network namespaces and
# volume mounts torn down), then whatever containerd still runs; the controllers must be
# stopped first so nothing recreates the pods. Leaves no mount under $dir.
drain_node() {
  local bin=$1 ctr=(ctr --address "$dir/containerd/containerd.sock" --namespace k8s.io) id
  if alive "$dir/kubelet.pid" && alive "$dir/kube-apiserver.pid"; then
    kubectl_admin delete pods --all --all-namespaces --force --grace-period=0 --wait=false >/dev/null 2>&1 || true
    wait_for "the kubelet's pod teardown" 60 bash -c "! ${ctr[*]} tasks ls -q | grep -q ." || true
  fi
  if alive "$dir/containerd.pid"; then
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks rm -f "$id" >/dev/null 2>&1 || true; done
    remove_stale_containers "$dir/containerd/containerd.sock"
  fi
  # kube-proxy's pod is gone with the rest; the chains it made are not.
  "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
}

# The iptables chains the kubelet makes at start (kube-proxy --cleanup takes its own); only
# after a kubelet of this cluster ran, so another's are never touched.
remove_kubelet_chains() {
  local ipt table
  for ipt in iptables ip6tables; do
    "$ipt" -D INPUT -j KUBE-FIREWALL 2>/dev/null || true
    "$ipt" -D OUTPUT -j KUBE-FIREWALL 2>/dev/null || true
    "$ipt" -F KUBE-FIREWALL 2>/dev/null || true
    "$ipt" -X KUBE-FIREWALL 2>/dev/null || true
    for table in mangle nat filter; do "$ipt" -t "$table" -X KUBE-KUBELET-CANARY 2>/dev/null || true; done
    "$ipt" -t mangle -X KUBE-IPTABLES-HINT 2>/dev/null || true
  done
}

# Whatever the kubelet or CNI left mounted under $dir, deepest first; and the pods' bridge.
unmount_all() {
  local m
  awk -v d="$dir" '$5 == d || index($5, d "/") == 1 {print $5}' /proc/self/mountinfo | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  ! ip link show greenroom0 >/dev/null 2>&1 || ip link delete greenroom0
}
