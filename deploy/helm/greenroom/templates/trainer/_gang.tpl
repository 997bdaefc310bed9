{{/* Gang scheduling (gang.scheduler): what each scheduler reads to place or admit all the
trainer pods at once. The PodGroup itself is in podgroup.yaml. */}}

{{/* The pods' schedulerName: as set, else volcano's own name under gang.scheduler volcano. */}}
{{- define "greenroom.gang.schedulerName" -}}
{{- if .Values.schedulerName -}}
{{- .Values.schedulerName -}}
{{- else if eq .Values.gang.scheduler "volcano" -}}
volcano
{{- end -}}
{{- end -}}

{{/* The PodGroup's name (one per release, named like the Job). */}}
{{- define "greenroom.gang.podGroupName" -}}
{{- include "greenroom.fullname" . -}}
{{- end -}}

{{/* Pod labels: the coscheduling plugin finds a pod's group by label. */}}
{{- define "greenroom.gang.podLabels" -}}
{{- if eq .Values.gang.scheduler "coscheduling" -}}
scheduling.x-k8s.io/pod-group: {{ include "greenroom.gang.podGroupName" . | quote }}
{{- end -}}
{{- end -}}

{{/* Pod annotations: Volcano finds a pod's group by annotation. */}}
{{- define "greenroom.gang.podAnnotations" -}}
{{- if eq .Values.gang.scheduler "volcano" -}}
scheduling.k8s.io/group-name: {{ include "greenroom.gang.podGroupName" . | quote }}
{{- end -}}
{{- end -}}

{{/* Labels of the Job or JobSet: Kueue finds its LocalQueue by label. */}}
{{- define "greenroom.gang.jobLabels" -}}
{{- if eq .Values.gang.scheduler "kueue" -}}
kueue.x-k8s.io/queue-name: {{ .Values.gang.queue | quote }}
{{- end -}}
{{- end -}}

{{/* Kueue starts a workload by unsuspending it: created suspended, nothing runs before admission. */}}
{{- define "greenroom.gang.suspend" -}}
{{- if eq .Values.gang.scheduler "kueue" -}}
suspend: true
{{- end -}}
{{- end -}}
