{{/* The trainer: its pod template, container, command and the seed flags. */}}

{{/* The seed flags and greenroom train's own, as a YAML list of strings. */}}
{{- define "greenroom.trainer.args" -}}
{{- $v := .Values -}}
- greenroom
- train
{{- if $v.offload.train }}
- --offload-train
- --offload-train-target
- {{ $v.offload.target | quote }}
{{- end }}
- --offload-train-disk-dir
- {{ $v.storage.mountPath | quote }}
- --offload-train-disk-chunk-mb
- {{ $v.offload.diskChunkMb | quote }}
- --offload-train-disk-compression
- {{ $v.offload.diskCompression | quote }}
{{- if $v.streamOptimizerState.toDisk }}
- --stream-optimizer-state-to-disk
- --stream-optimizer-state-moment-dtype
- {{ $v.streamOptimizerState.momentDtype | quote }}
{{- if $v.streamOptimizerState.hostCacheGb }}
- --stream-optimizer-state-host-cache-gb
- {{ $v.streamOptimizerState.hostCacheGb | quote }}
{{- end }}
{{- end }}
{{- if $v.noLoadOptim }}
- --no-load-optim
{{- end }}
{{- if not (kindIs "invalid" $v.train.iterations) }}
- --iterations
- {{ $v.train.iterations | quote }}
{{- end }}
- --role
- {{ $v.train.role | quote }}
{{- with $v.train.save }}
- --save
- {{ . | quote }}
{{- end }}
{{- with $v.train.load }}
- --load
- {{ . | quote }}
{{- end }}
{{- range $v.train.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The trainer container's command and args. */}}
{{- define "greenroom.trainer.command" -}}
{{- $v := .Values -}}
{{- if $v.command }}
command:
{{- toYaml $v.command | nindent 2 }}
{{- with $v.args }}
args:
{{- toYaml . | nindent 2 }}
{{- end }}
{{- else if $v.torchrun.enabled }}
command:
  - torchrun
args:
  - {{ printf "--nnodes=%d" (int $v.nodes) | quote }}
  - {{ printf "--nproc-per-node=%d" (int $v.procsPerNode) | quote }}
  - "--node-rank=$(GREENROOM_NODE_RANK)"
  - "--master-addr=$(GREENROOM_MASTER_ADDR)"
  - {{ printf "--master-port=%d" (int $v.torchrun.port) | quote }}
{{- range $v.torchrun.extraArgs }}
  - {{ . | quote }}
{{- end }}
  - --no-python
{{- include "greenroom.trainer.args" . | nindent 2 }}
{{- else }}
command:
{{- include "greenroom.trainer.args" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The preStop hook: reclaims the pod's own dir (the trainer's --offload-train-disk-dir).
Ranks still running hold their locks and are kept: they remove their own dirs on the
SIGTERM that follows. Never fails the hook (a failed hook only delays termination).
*/}}
{{- define "greenroom.trainer.preStopScript" -}}
greenroom reclaim "$GREENROOM_DISK_DIR" || true
{{- end -}}

{{/* The trainer container. */}}
{{- define "greenroom.trainer.container" -}}
{{- $v := .Values -}}
- name: trainer
  image: {{ include "greenroom.image" . }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- include "greenroom.trainer.command" . | trim | nindent 2 }}
  env:
    - name: GREENROOM_JOB_ID
      valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/controller-uid']"}}
    - name: GREENROOM_NODE_RANK
      valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/job-completion-index']"}}
    - name: GREENROOM_MASTER_ADDR
      value: {{ include "greenroom.masterAddr" . | quote }}
    - name: GREENROOM_DISK_DIR
      value: {{ $v.storage.mountPath | quote }}
    - name: GREENROOM_POD_UID
      valueFrom: {fieldRef: {fieldPath: metadata.uid}}
    - name: GREENROOM_POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: GREENROOM_POD_NAMESPACE
      valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
    - name: GREENROOM_NODE_NAME
      valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
    {{- with $v.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $v.gpu.count $v.resources }}
  resources:
    {{- $res := deepCopy (default (dict) $v.resources) -}}
    {{- if $v.gpu.count -}}
    {{- $limits := default (dict) $res.limits -}}
    {{- $_ := set $limits $v.gpu.resourceName (int $v.gpu.count) -}}
    {{- $_ := set $res "limits" $limits -}}
    {{- end }}
    {{- toYaml $res | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  {{- if $v.reclaim.preStop.enabled }}
  lifecycle:
    preStop:
      exec:
        command:
          - /bin/sh
          - -c
          - {{ include "greenroom.trainer.preStopScript" . | quote }}
  {{- end }}
  {{- if and $v.torchrun.enabled (not $v.command) }}
  ports:
    - name: rendezvous
      containerPort: {{ $v.torchrun.port }}
  {{- end }}
  volumeMounts:
    - name: offload
      mountPath: {{ $v.storage.mountPath }}
      subPathExpr: $(GREENROOM_POD_UID)
    {{- if $v.shmSizeLimit }}
    - name: dshm
      mountPath: /dev/shm
    {{- end }}
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The pod's volumes: the node-local NVMe (hostPath or a disk emptyDir) and /dev/shm. */}}
{{- define "greenroom.trainer.volumes" -}}
{{- $v := .Values -}}
- name: offload
  {{- if eq $v.storage.type "emptyDir" }}
  emptyDir:
    sizeLimit: {{ $v.storage.emptyDir.sizeLimit }}
  {{- else }}
  hostPath:
    path: {{ $v.storage.hostPath.path }}
    type: {{ $v.storage.hostPath.type }}
  {{- end }}
{{- if $v.shmSizeLimit }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.shmSizeLimit }}
{{- end }}
{{- with $v.extraVolumes }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end -}}

{{/* The pod template shared by the Job and the JobSet. */}}
{{- define "greenroom.trainer.podTemplate" -}}
{{- $v := .Values -}}
metadata:
  labels:
    {{- include "greenroom.labels" . | nindent 4 }}
    app.kubernetes.io/component: trainer
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  restartPolicy: Never
  {{- if ne $v.workload "jobset" }}
  subdomain: {{ include "greenroom.fullname" . }}
  {{- end }}
  automountServiceAccountToken: false
  {{- with $v.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
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
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- if $v.reclaim.initContainer.enabled }}
  initContainers:
    {{- include "greenroom.init.container" . | nindent 4 }}
  {{- end }}
  containers:
    {{- include "greenroom.trainer.container" . | nindent 4 }}
  volumes:
    {{- include "greenroom.trainer.volumes" . | nindent 4 }}
{{- end -}}

{{/* The Job spec shared by the Job and the JobSet's replicated job. */}}
{{- define "greenroom.trainer.jobSpec" -}}
{{- $v := .Values -}}
completionMode: Indexed
completions: {{ $v.nodes }}
parallelism: {{ $v.nodes }}
backoffLimit: {{ $v.job.backoffLimit }}
# A failed pod is replaced only once it has fully terminated, so two pods of one rank
# never share the node's files or the rendezvous.
podReplacementPolicy: Failed
{{- if not (kindIs "invalid" $v.job.ttlSecondsAfterFinished) }}
ttlSecondsAfterFinished: {{ $v.job.ttlSecondsAfterFinished }}
{{- end }}
{{- if not (kindIs "invalid" $v.job.activeDeadlineSeconds) }}
activeDeadlineSeconds: {{ $v.job.activeDeadlineSeconds }}
{{- end }}
template:
  {{- include "greenroom.trainer.podTemplate" . | nindent 2 }}
{{- end -}}
