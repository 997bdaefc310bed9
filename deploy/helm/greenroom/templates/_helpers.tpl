{{/* Names and labels. */}}
{{- define "greenroom.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Kept short: Indexed Job pod hostnames are <name>-<index>, JobSet's <name>-trainer-0-<index>. */}}
{{- define "greenroom.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "greenroom.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "greenroom.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "greenroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "greenroom.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{- define "greenroom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" | quote }}
{{ include "greenroom.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/part-of: greenroom
{{- end -}}

{{- define "greenroom.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Pod 0's DNS name: torchrun's rendezvous host. */}}
{{- define "greenroom.masterAddr" -}}
{{- $name := include "greenroom.fullname" . -}}
{{- if eq .Values.workload "jobset" -}}
{{- printf "%s-trainer-0-0.%s" $name $name -}}
{{- else -}}
{{- printf "%s-0.%s" $name $name -}}
{{- end -}}
{{- end -}}

{{/* Paths inside the containers. */}}
{{- define "greenroom.nodeRootMount" -}}/greenroom/node{{- end -}}

{{/*
A value Kubernetes must pass on as it is written. It expands $(VAR) in env values and
container args and turns $$ into $, but not in a volume's mountPath: the same path in both
places would differ without every $ doubled.
*/}}
{{- define "greenroom.k8sLiteral" -}}
{{- replace "$" "$$" . -}}
{{- end -}}

{{/* One word as shlex.join writes it: bare when only safe characters, else single-quoted. */}}
{{- define "greenroom.shellWord" -}}
{{- if regexMatch "^[A-Za-z0-9_@%+=:,./-]+$" . -}}
{{- . -}}
{{- else -}}
{{- printf "'%s'" (replace "'" "'\"'\"'" .) -}}
{{- end -}}
{{- end -}}

{{/* The Pod Security Standards level the trainer pods need with these values. */}}
{{- define "greenroom.podSecurityLevel" -}}
{{- if or (eq .Values.storage.mode "hostPath") .Values.ipcLock -}}privileged{{- else -}}restricted{{- end -}}
{{- end -}}
