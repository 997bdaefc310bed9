{{/* The trainer's pod template and Job spec, shared by the Job and the JobSet. */}}

{{/* The offload volume of each storage.mode, /dev/shm and hugepages. */}}
{{- define "greenroom.trainer.volumes" -}}
{{- $v := .Values -}}
{{- $s := $v.storage -}}
- name: offload
  {{- if eq $s.mode "hostPath" }}
  hostPath:
    path: {{ $s.hostPath.path | quote }}
    type: {{ $s.hostPath.type | quote }}
  {{- else if eq $s.mode "emptyDir" }}
  emptyDir:
    sizeLimit: {{ $s.emptyDir.sizeLimit | quote }}
  {{- else if eq $s.mode "ephemeral" }}
  # A generic ephemeral volume: provisioned for this pod, deleted with it.
  ephemeral:
    volumeClaimTemplate:
      metadata:
        labels:
          {{- include "greenroom.selectorLabels" . | nindent 10 }}
          app.kubernetes.io/component: offload
      spec:
        accessModes:
          {{- toYaml $s.ephemeral.accessModes | nindent 10 }}
        {{- with $s.ephemeral.storageClassName }}
        storageClassName: {{ . | quote }}
        {{- end }}
        resources:
          requests:
            storage: {{ $s.ephemeral.size | quote }}
  {{- else }}
  persistentVolumeClaim:
    claimName: {{ $s.pvc.claimName | quote }}
  {{- end }}
{{- if $v.shmSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSizeLimit | quote }}
{{- end }}
{{- if $v.hugepages.size }}
- name: hugepages
  emptyDir:
    medium: {{ printf "HugePages-%s" $v.hugepages.size | quote }}
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels that select this release's trainer pods. */}}
{{- define "greenroom.trainer.selectorLabels" -}}
{{ include "greenroom.selectorLabels" . }}
app.kubernetes.io/component: trainer
{{- end -}}

{{/* `affinity`, or for a multi-node job one pod per node (ranks never share a node's NVMe). */}}
{{- define "greenroom.trainer.affinity" -}}
{{- $v := .Values -}}
{{- if $v.affinity -}}
{{ toYaml $v.affinity }}
{{- else if and $v.onePodPerNode (gt (int $v.nodes) 1) -}}
podAntiAffinity:
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: kubernetes.io/hostname
      labelSelector:
        matchLabels:
          {{- include "greenroom.trainer.selectorLabels" . | nindent 10 }}
{{- end -}}
{{- end -}}

{{/* The pod template. */}}
{{- define "greenroom.trainer.podTemplate" -}}
{{- $v := .Values -}}
metadata:
  labels:
    {{- include "greenroom.labels" . | nindent 4 }}
    app.kubernetes.io/component: trainer
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with (include "greenroom.gang.podLabels" .) }}
    {{- . | nindent 4 }}
    {{- end }}
  annotations:
    greenroom.dev/pod-security-level: {{ include "greenroom.podSecurityLevel" . | quote }}
    {{- with (include "greenroom.gang.podAnnotations" .) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  restartPolicy: Never
  {{- if ne $v.workload "jobset" }}
  subdomain: {{ include "greenroom.fullname" . | quote }}
  {{- end }}
  automountServiceAccountToken: false
  {{- with $v.serviceAccountName }}
  serviceAccountName: {{ . | quote }}
  {{- end }}
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with (include "greenroom.gang.schedulerName" .) }}
  schedulerName: {{ . | quote }}
  {{- end }}
  {{- with $v.runtimeClassName }}
  runtimeClassName: {{ . | quote }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . | quote }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . | quote }}
    {{- end }}
  {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with (include "greenroom.trainer.affinity" .) }}
  affinity:
    {{- . | nindent 4 }}
  {{- end }}
  {{- with $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- if and $v.reclaim.initContainer.enabled (has $v.storage.mode (list "hostPath" "pvc")) }}
  initContainers:
    {{- include "greenroom.init.container" . | trim | nindent 4 }}
  {{- end }}
  containers:
    {{- include "greenroom.trainer.container" . | nindent 4 }}
  volumes:
    {{- include "greenroom.trainer.volumes" . | nindent 4 }}
{{- end -}}

{{/* The pod failure policy: disruptions run again uncounted, a config error fails the Job. */}}
{{- define "greenroom.trainer.podFailurePolicy" -}}
{{- $p := .Values.job.podFailurePolicy -}}
rules:
  - action: Ignore
    onPodConditions:
      - type: DisruptionTarget
        status: "True"
  {{- with $p.failExitCodes }}
  - action: FailJob
    onExitCodes:
      containerName: trainer
      operator: In
      values: {{ toJson . }}
  {{- end }}
  {{- with $p.restartExitCodes }}
  - action: Count
    onExitCodes:
      containerName: trainer
      operator: In
      values: {{ toJson . }}
  {{- end }}
{{- end -}}

{{/* The Job spec shared by the Job and the JobSet's replicated job. */}}
{{- define "greenroom.trainer.jobSpec" -}}
{{- $v := .Values -}}
completionMode: Indexed
completions: {{ $v.nodes }}
parallelism: {{ $v.nodes }}
# Per index. A lost rank's peers fail too (their collective ends, exit 1) and are run
# again as well: the static rendezvous admits no newcomer into a running group, so every
# rank meets again there and resumes from the last save. Bounded: the rendezvous by
# torchrun.rendezvousTimeoutSeconds, the reruns of a rank by this limit (then the Job
# fails, maxFailedIndexes 0).
backoffLimitPerIndex: {{ $v.job.backoffLimitPerIndex }}
{{- if not (kindIs "invalid" $v.job.maxFailedIndexes) }}
maxFailedIndexes: {{ $v.job.maxFailedIndexes }}
{{- end }}
# A failed pod is replaced only once it has fully terminated, so two pods of one rank
# never share the node's files or the rendezvous.
podReplacementPolicy: Failed
{{- if $v.job.podFailurePolicy.enabled }}
podFailurePolicy:
  {{- include "greenroom.trainer.podFailurePolicy" . | nindent 2 }}
{{- end }}
{{- if not (kindIs "invalid" $v.job.ttlSecondsAfterFinished) }}
ttlSecondsAfterFinished: {{ $v.job.ttlSecondsAfterFinished }}
{{- end }}
{{- if not (kindIs "invalid" $v.job.activeDeadlineSeconds) }}
activeDeadlineSeconds: {{ $v.job.activeDeadlineSeconds }}
{{- end }}
template:
  {{- include "greenroom.trainer.podTemplate" . | nindent 2 }}
{{- end -}}
