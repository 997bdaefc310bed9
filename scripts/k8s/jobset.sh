# shellcheck shell=bash disable=SC2154  # dir: set by scripts/services.d/k8s.sh
# The JobSet controller, sourced by scripts/services.d/k8s.sh (helpers: status, why_not_ready,
# kubectl_admin; program_image from scripts/k8s/node.sh). It runs in the cluster as the
# JobSet project deploys it: the module release's own config/default (the CRD, the
# jobset-system namespace, the controller's ServiceAccount and RBAC, its Deployment, the
# webhook Service and configurations, the internal cert management that writes the
# webhook's serving cert into a Secret and the CA into the webhook configurations). Only
# the image differs: upstream's is in a registry this machine cannot reach, so the
# controller built by scripts/k8s/build.sh is packaged on the CI base (program_image) and
# imported into the node's containerd.

crd_established() {
  kubectl_admin get crd jobsets.jobset.x-k8s.io \
    -o jsonpath='{.status.conditions[?(@.type=="Established")].status}' | grep -qx True
}

# The JobSet webhook answers once the controller has written its cert and the CA is in
# the webhook configuration: a server-side dry run of a JobSet goes through the webhooks.
jobset_webhook_answers() {
  kubectl_admin create --dry-run=server -f - <<EOF2
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata: {name: webhook-probe, namespace: default}
spec:
  replicatedJobs:
  - name: probe
    template:
      spec:
        template:
          spec:
            restartPolicy: Never
            containers: [{name: probe, image: localhost/greenroom-pause:1}]
EOF2
}

# apply_jobset BIN: upstream's manifests with the local image (never pulled) and its path
# in that image. It does not wait: the controller comes up while the rest of the cluster does.
apply_jobset() {
  local bin=$1 image
  image=$(program_image localhost/greenroom-jobset "$bin/jobset" "USER 65532:65532") ||
    { status jobset "the JobSet controller image could not be built"; return 1; }
  echo "$image" >"$dir/jobset-image"
  # kustomize warns that upstream's kustomization uses the deprecated commonLabels.
  kubectl kustomize "$bin/jobset-config/default" 2>"$dir/log/jobset-kustomize.log" | python3 -c '
import json, sys, yaml
image = sys.argv[1]
items = [d for d in yaml.safe_load_all(sys.stdin) if d]
for item in items:
    if item["kind"] == "Deployment":
        for container in item["spec"]["template"]["spec"]["containers"]:
            container.update(image=image, imagePullPolicy="Never", command=["/jobset"])
json.dump({"apiVersion": "v1", "kind": "List", "items": items}, sys.stdout)
' "$image" | kubectl_admin apply --server-side -f - >/dev/null ||
    { status jobset "upstream's manifests (config/default) were not applied: $(tail -1 "$dir/log/jobset-kustomize.log")"; return 1; }
}

# wait_jobset: the controller ready and its webhooks answering.
wait_jobset() {
  wait_for "the JobSet CRD" 60 crd_established
  if ! kubectl_admin -n jobset-system rollout status deployment/jobset-controller-manager --timeout=180s >/dev/null; then
    status jobset "the controller did not become ready: $(why_not_ready jobset-system deployment/jobset-controller-manager)"
    return 0
  fi
  wait_for "the JobSet webhook" 120 jobset_webhook_answers ||
    { status jobset "the webhook did not answer: $(jobset_webhook_answers 2>&1 | tail -1)"; return 0; }
  status jobset "up (sigs.k8s.io/jobset in jobset-system, $(cat "$dir/jobset-image"))"
}
