# shellcheck shell=bash disable=SC2154  # dir, node_name, pod_cidr: set by services.d/k8s.sh and node.sh
# kube-proxy for the test cluster, sourced by scripts/services.d/k8s.sh (its helpers: status,
# why_not_ready, kubectl_admin; program_image from scripts/k8s/node.sh): a
# DaemonSet in kube-system as kubeadm runs it: host network, privileged (it writes the
# node's iptables rules), its own ServiceAccount bound to the built-in system:node-proxier
# role. It reaches the API server by the node's address, not by the `kubernetes` Service
# whose rules it makes itself.

start_proxy() {
  local bin=$1 ip=$2 image
  # The image brings Debian's iptables and conntrack, the same as the node's.
  image=$(program_image localhost/greenroom-kube-proxy "$bin/kube-proxy" "ENV DEBIAN_FRONTEND=noninteractive" \
    "RUN apt-get -qq -o APT::Sandbox::User=root update && apt-get -qq -o APT::Sandbox::User=root install -y --no-install-recommends iptables conntrack >/dev/null && rm -rf /var/lib/apt/lists/*") ||
    { status node "the kube-proxy image could not be built"; return 1; }
  kubectl_admin apply -f - >/dev/null <<MANIFESTS
apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-proxy, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "greenroom-test:kube-proxy"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:node-proxier"}
subjects: [{kind: ServiceAccount, name: kube-proxy, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: kube-proxy, namespace: kube-system}
data:
  config.yaml: |
    apiVersion: kubeproxy.config.k8s.io/v1alpha1
    kind: KubeProxyConfiguration
    clientConnection: {kubeconfig: /etc/kube-proxy/kubeconfig}
    mode: iptables
    clusterCIDR: $pod_cidr
    bindAddress: 127.0.0.1
    healthzBindAddress: 127.0.0.1:10256
    metricsBindAddress: 127.0.0.1:10249
    conntrack: {maxPerCore: 0}
  kubeconfig: |
    apiVersion: v1
    kind: Config
    clusters: [{name: local, cluster: {server: "https://$ip:6443", certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt}}]
    users: [{name: kube-proxy, user: {tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token}}]
    contexts: [{name: local, context: {cluster: local, user: kube-proxy}}]
    current-context: local
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-proxy, namespace: kube-system, labels: {k8s-app: kube-proxy}}
spec:
  selector: {matchLabels: {k8s-app: kube-proxy}}
  template:
    metadata: {labels: {k8s-app: kube-proxy}}
    spec:
      serviceAccountName: kube-proxy
      priorityClassName: system-node-critical
      hostNetwork: true
      # The nodes share the host's network namespace: one kube-proxy writes its rules
      # (scripts/k8s/node2.sh).
      nodeSelector: {kubernetes.io/hostname: $node_name}
      tolerations: [{operator: Exists}]
      containers:
      - name: kube-proxy
        image: $image
        imagePullPolicy: Never
        command: [/kube-proxy, --config=/etc/kube-proxy/config.yaml, --hostname-override=\$(NODE_NAME)]
        env: [{name: NODE_NAME, valueFrom: {fieldRef: {fieldPath: spec.nodeName}}}]
        securityContext: {privileged: true}
        # The kubelet probes from the node's network: its loopback is kube-proxy's.
        readinessProbe: {httpGet: {host: 127.0.0.1, path: /healthz, port: 10256}, periodSeconds: 2}
        volumeMounts:
        - {name: config, mountPath: /etc/kube-proxy, readOnly: true}
        - {name: xtables-lock, mountPath: /run/xtables.lock}
        - {name: lib-modules, mountPath: /lib/modules, readOnly: true}
      volumes:
      - {name: config, configMap: {name: kube-proxy}}
      - {name: xtables-lock, hostPath: {path: /run/xtables.lock, type: FileOrCreate}}
      - {name: lib-modules, hostPath: {path: /lib/modules}}
MANIFESTS
  if ! kubectl_admin -n kube-system rollout status daemonset/kube-proxy --timeout=120s >/dev/null; then
    status node "kube-proxy did not become ready: $(why_not_ready kube-system daemonset/kube-proxy)"
    return 1
  fi
}
