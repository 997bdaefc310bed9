{{/*
What the schema cannot say (it compares no two values), refused the way `greenroom slurm`
refuses it: one line naming the values and the fix. Included once, from the Job template.
*/}}
{{- define "greenroom.validate" -}}
{{- $v := .Values -}}
{{- if and $v.gpu.count (gt (int $v.procsPerNode) (int $v.gpu.count)) -}}
{{- fail (printf "procsPerNode %d > gpu.count %d: each process needs its own GPU; use at most one process per GPU" (int $v.procsPerNode) (int $v.gpu.count)) -}}
{{- end -}}
{{- if and (not $v.torchrun.enabled) (gt (int $v.procsPerNode) 1) -}}
{{- fail (printf "procsPerNode %d needs torchrun.enabled: without a launcher each pod runs one process" (int $v.procsPerNode)) -}}
{{- end -}}
{{- if and $v.hugepages.size (not $v.hugepages.amount) -}}
{{- fail "hugepages.size needs hugepages.amount (e.g. 4Gi)" -}}
{{- end -}}
{{- if $v.hugepages.size -}}
{{- $r := default (dict) $v.resources -}}
{{- $asked := merge (deepCopy (default (dict) $r.requests)) (default (dict) $r.limits) -}}
{{- if not (or (hasKey $asked "memory") (hasKey $asked "cpu")) -}}
{{- fail "hugepages need a cpu or memory request in resources (Kubernetes refuses hugepages alone)" -}}
{{- end -}}
{{- end -}}
{{- /* The container's securityContext wins over the pod's, as in Kubernetes. */ -}}
{{- $nonRoot := false -}}
{{- range (list $v.podSecurityContext $v.securityContext) -}}
{{- if and . (hasKey . "runAsNonRoot") -}}{{- $nonRoot = index . "runAsNonRoot" -}}{{- end -}}
{{- end -}}
{{- if and $nonRoot (eq (include "greenroom.trainer.runAsSet" (dict "ctx" . "key" "runAsUser")) "0") -}}
{{- fail "runAsUser 0 (root) with runAsNonRoot true: the kubelet would never start the trainer; set podSecurityContext.runAsNonRoot=false beside runAsUser 0 (the default podSecurityContext says runAsNonRoot true)" -}}
{{- end -}}
{{- if eq (include "greenroom.podSecurityLevel" .) "privileged" -}}
{{- /* On a real install (lookup is empty under helm template): say which level is needed. */ -}}
{{- $ns := lookup "v1" "Namespace" "" .Release.Namespace -}}
{{- $enforce := "" -}}
{{- if $ns -}}{{- $enforce = index (default (dict) $ns.metadata.labels) "pod-security.kubernetes.io/enforce" | default "" -}}{{- end -}}
{{- if has $enforce (list "baseline" "restricted") -}}
{{- fail (printf "namespace %s enforces Pod Security %q, and these values need \"privileged\" (storage.mode hostPath: a hostPath volume and a root init container; ipcLock: an added capability): use storage.mode ephemeral, emptyDir or pvc without ipcLock (they pass restricted), or install into a privileged namespace" .Release.Namespace $enforce) -}}
{{- end -}}
{{- end -}}
{{- end -}}
