# shellcheck shell=bash disable=SC2154  # dir: set by scripts/services.d/k8s.sh
# The JobSet controller, sourced by scripts/services.d/k8s.sh (helpers: daemon, wait_for,
# status, kubectl_admin; variables: dir). It runs on the node as a host process, so its
# admission webhooks are reached by URL (the node's address, a cert from the cluster CA)
# instead of through a Service; the CRD and webhook rules are the module release's own.

jobset_webhook_port=9443

crd_established() {
  kubectl_admin get crd jobsets.jobset.x-k8s.io \
    -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' | grep -qx True
}

start_jobset() {
  local bin=$1 ip=$2
  local config="$bin/jobset-config"
  mkdir -p "$dir/jobset/certs"
  cp "$dir/pki/jobset-webhook.crt" "$dir/jobset/certs/tls.crt"
  cp "$dir/pki/jobset-webhook.key" "$dir/jobset/certs/tls.key"
  cat >"$dir/jobset/config.yaml" <<EOF
apiVersion: config.jobset.x-k8s.io/v1alpha1
kind: Configuration
leaderElection: {leaderElect: false}
internalCertManagement: {enable: false}
webhook: {port: $jobset_webhook_port, host: $ip, certDir: $dir/jobset/certs}
metrics: {bindAddress: "127.0.0.1:8443", certDir: $dir/jobset/certs}
health: {healthProbeBindAddress: "127.0.0.1:8082"}
EOF
  kubectl_admin apply --server-side -f "$config/crd/bases/" >/dev/null
  wait_for "the JobSet CRD" 60 crd_established
  # The controller is a host process with the admin kubeconfig: in this test cluster it
  # stands where upstream's Deployment and its ServiceAccount would.
  KUBECONFIG="$dir/admin.kubeconfig" daemon jobset "$bin/jobset" --config "$dir/jobset/config.yaml"
  wait_for "the JobSet controller" 60 curl -fsS http://127.0.0.1:8082/readyz || {
    status jobset "the controller did not become ready: $(tail -1 "$dir/log/jobset.log")"; return 0; }
  # Upstream's webhook configurations (with their pod objectSelector patches), pointed at
  # the controller by URL.
  local ca
  ca=$(base64 -w0 "$dir/pki/ca.crt")
  kubectl kustomize "$config/webhook" | python3 -c '
import json, sys, yaml
url, ca = sys.argv[1], sys.argv[2]
hooks = [d for d in yaml.safe_load_all(sys.stdin) if d and d["kind"].endswith("WebhookConfiguration")]
for item in hooks:
    item["metadata"]["name"] = "jobset-" + item["metadata"]["name"]
    for hook in item["webhooks"]:
        hook["clientConfig"] = {"url": url + hook["clientConfig"]["service"]["path"], "caBundle": ca}
json.dump({"apiVersion": "v1", "kind": "List", "items": hooks}, sys.stdout)
' "https://$ip:$jobset_webhook_port" "$ca" | kubectl_admin apply -f - >/dev/null
  status jobset "up (sigs.k8s.io/jobset controller and webhooks)"
}
