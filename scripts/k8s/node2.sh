# shellcheck shell=bash disable=SC2154  # dir, node2_name: set by scripts/services.d/k8s.sh
# The test cluster's second node, sourced by scripts/services.d/k8s.sh (its helpers: daemon,
# wait_for, status, kubectl_admin, alive; from scripts/k8s/node.sh: write_node_configs,
# import_pause_image, remove_stale_containers): its own containerd (its own image store,
# ~/.cache/greenroom-k8s/containerd-2, so the greenroom image is imported once per tag
# there too) and kubelet, on the same host and network namespace as the first node.
# What two nodes on one host share, and how they are kept apart:
# - the network: node 2's pods are on their own bridge and subnet (greenroom1,
#   10.245.0.0/16), routed by the host; the first node's kube-proxy writes the host's
#   service rules for both (a second kube-proxy in the same namespace would fight it), so
#   kube-proxy stays off node 2 (scripts/k8s/proxy.sh);
# - the kubelet's ports, cgroup root (/greenroom-node2) and pod log dir are node 2's own;
# - the filesystem: a hostPath is the same directory on both, which no real cluster has;
#   so node 2 registers with the taint greenroom.dev/second-node:NoSchedule, and only
#   pods that tolerate it (the multi-node tests) run there.

node2_bridge=greenroom1
node2_cidr=10.245.0.0/16
node2_taint=greenroom.dev/second-node
node2_cgroup=greenroom-node2
containerd2_root="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}/containerd-2"

node2_ready() {
  kubectl_admin get node "$node2_name" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True
}

# The cgroup v1 hierarchies' dirs of node 2's root (the kubelet wants them to exist).
node2_cgroup_dirs() {
  local h
  for h in /sys/fs/cgroup/*/; do [ -L "${h%/}" ] || echo "$h$node2_cgroup"; done
}

start_node2() {
  local bin=$1 ip=$2 nd="$dir/node2" image
  local sock="$nd/containerd/containerd.sock"
  write_node_configs "$bin" "$ip" "$nd" "$containerd2_root" "$node2_bridge" "$node2_cidr" kubelet-2
  printf '%s\n' "port: 10260" "healthzPort: 10258" "cgroupRoot: /$node2_cgroup" "podLogsDir: $nd/pod-logs" \
    "registerWithTaints: [{key: $node2_taint, effect: NoSchedule}]" >>"$nd/kubelet/config.yaml"
  node2_cgroup_dirs | xargs -r mkdir -p
  daemon containerd-2 containerd --config "$nd/containerd/config.toml"
  wait_for "containerd of node 2" 30 ctr --address "$sock" version || {
    status node2 "containerd did not start: $(tail -1 "$dir/log/containerd-2.log")"; return 0; }
  remove_stale_containers "$sock"
  import_pause_image "$bin" "$sock" ||
    { status node2 "the pause image could not be imported into its containerd"; return 0; }
  if ! image=$(scripts/k8s/image.sh "$sock" | tail -1); then
    status node2 "${image:-scripts/k8s/image.sh failed for its containerd (see its output above)}"; return 0
  fi
  daemon kubelet-2 "$bin/kubelet" --config="$nd/kubelet/config.yaml" --kubeconfig="$dir/kubelet-2.kubeconfig" \
    --root-dir="$nd/kubelet/root" --hostname-override="$node2_name" --node-ip="$ip"
  if ! wait_for "node $node2_name" 90 node2_ready; then
    status node2 "the kubelet did not make $node2_name Ready: $(grep -E '^E[0-9]{4}' "$dir/log/kubelet-2.log" | tail -1)"
    return 0
  fi
  status node2 "up ($node2_name Ready, tainted $node2_taint:NoSchedule, $image)"
}

# Like drain_node, for node 2 (drain_node deletes the pods of both nodes first).
stop_node2_tasks() {
  local sock="$dir/node2/containerd/containerd.sock" id
  local ctr=(ctr --address "$sock" --namespace k8s.io)
  alive "$dir/containerd-2.pid" || return 0
  wait_for "node 2's pod teardown" 60 bash -c "! ${ctr[*]} tasks ls -q | grep -q ." || true
  for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
  for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks rm -f "$id" >/dev/null 2>&1 || true; done
  remove_stale_containers "$sock"
}

# After both kubelets stopped: node 2's bridge and its (empty) cgroup dirs.
remove_node2_leftovers() {
  local d
  ! ip link show "$node2_bridge" >/dev/null 2>&1 || ip link delete "$node2_bridge"
  node2_cgroup_dirs | while read -r d; do
    [ ! -d "$d" ] || find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}
