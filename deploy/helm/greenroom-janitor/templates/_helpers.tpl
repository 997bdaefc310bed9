{{/* Names and labels. */}}
{{- define "greenroom-janitor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Kept short: the DaemonSet's pod names add a suffix. */}}
{{- define "greenroom-janitor.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else if contains (include "greenroom-janitor.name" .) .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "greenroom-janitor.name" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Objects outside the release namespace (the ClusterRole and its binding, the events Role
in "default"): the release namespace in the name, so installs in two namespaces never
claim one object. */}}
{{- define "greenroom-janitor.globalName" -}}
{{- printf "%s-%s" (include "greenroom-janitor.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "greenroom-janitor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "greenroom-janitor.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: janitor
{{- end -}}

{{- define "greenroom-janitor.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" | quote }}
{{ include "greenroom-janitor.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/part-of: greenroom
{{- end -}}

{{- define "greenroom-janitor.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Where the container sees the node's root. */}}
{{- define "greenroom-janitor.rootMount" -}}/greenroom/node{{- end -}}
