# shellcheck shell=bash disable=SC2154  # dir: set by scripts/services.d/k8s.sh
# Cluster DNS for the test cluster, sourced by scripts/services.d/k8s.sh (its helpers:
# status, why_not_ready, kubectl_admin; program_image from scripts/k8s/node.sh): CoreDNS (built by scripts/k8s/build.sh) as a Deployment in
# kube-system with its own ServiceAccount and read-only RBAC, behind the kube-dns Service
# whose ClusterIP the kubelet hands to every pod. It finds the API server the in-cluster
# way (the `kubernetes` Service and its ServiceAccount token).

dns_ip=10.96.0.10   # the kube-dns Service's ClusterIP (the kubelet's clusterDNS)
dns_port=1053       # CoreDNS's port in its pod: above 1024, so it needs no capability

start_dns() {
  local bin=$1 image
  image=$(program_image localhost/greenroom-coredns "$bin/coredns" "USER 65534:65534") ||
    { status dns "the CoreDNS image could not be built"; return 0; }
  kubectl_admin apply -f - >/dev/null <<MANIFESTS
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "greenroom-test:coredns"}
rules:
- {apiGroups: [""], resources: [endpoints, services, pods, namespaces], verbs: [list, watch]}
- {apiGroups: [discovery.k8s.io], resources: [endpointslices], verbs: [list, watch]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "greenroom-test:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "greenroom-test:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:$dns_port {
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
        }
        cache 5
        forward . /etc/resolv.conf
    }
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: coredns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata: {labels: {k8s-app: kube-dns}}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default   # forward to the node's resolvers, not to itself
      securityContext: {runAsNonRoot: true, seccompProfile: {type: RuntimeDefault}}
      containers:
      - name: coredns
        image: $image
        imagePullPolicy: Never
        command: [/coredns, -conf, /etc/coredns/Corefile]
        ports:
        - {name: dns, containerPort: $dns_port, protocol: UDP}
        - {name: dns-tcp, containerPort: $dns_port, protocol: TCP}
        readinessProbe: {httpGet: {path: /ready, port: 8181}, periodSeconds: 2}
        livenessProbe: {httpGet: {path: /health, port: 8080}, periodSeconds: 10}
        securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
        volumeMounts: [{name: config, mountPath: /etc/coredns, readOnly: true}]
      volumes: [{name: config, configMap: {name: coredns}}]
---
apiVersion: v1
kind: Service
metadata: {name: kube-dns, namespace: kube-system, labels: {k8s-app: kube-dns}}
spec:
  clusterIP: $dns_ip
  selector: {k8s-app: kube-dns}
  ports:
  - {name: dns, port: 53, targetPort: dns, protocol: UDP}
  - {name: dns-tcp, port: 53, targetPort: dns-tcp, protocol: TCP}
MANIFESTS
  if kubectl_admin -n kube-system rollout status deployment/coredns --timeout=120s >/dev/null; then
    status dns "up (CoreDNS in kube-system, $image)"
  else
    status dns "CoreDNS did not become ready: $(why_not_ready kube-system deployment/coredns)"
  fi
}
