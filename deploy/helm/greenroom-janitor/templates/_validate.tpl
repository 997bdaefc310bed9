{{/*
Refuses, in one line, a namespace whose Pod Security admission would refuse every janitor
pod: the DaemonSet would be created and stay empty. Its hostPath volume needs "privileged"
whatever runAsUser is, and every version of baseline refuses hostPath volumes, so neither
enforce-version nor the values change the answer. lookup is empty under helm template and
for a namespace not there yet (--create-namespace: unlabelled, the cluster's default level,
which no API object shows); with no enforce label, the same: nothing to say. It runs at
helm upgrade too: a namespace relabelled since would refuse the pods the upgrade rolls out.
Included once, from the DaemonSet template.
*/}}
{{- define "greenroom-janitor.validate" -}}
{{- $ns := lookup "v1" "Namespace" "" .Release.Namespace -}}
{{- $enforce := "" -}}
{{- if $ns -}}{{- $enforce = index (default (dict) $ns.metadata.labels) "pod-security.kubernetes.io/enforce" | default "" -}}{{- end -}}
{{- if has $enforce (list "baseline" "restricted") -}}
{{- fail (printf "namespace %s enforces Pod Security %q, and the janitor needs \"privileged\" (a hostPath volume, the node root %s): label it (kubectl label namespace %s pod-security.kubernetes.io/enforce=privileged --overwrite) or install into a privileged namespace" .Release.Namespace $enforce .Values.root .Release.Namespace) -}}
{{- end -}}
{{- end -}}
