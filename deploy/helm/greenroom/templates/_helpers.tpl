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
app.kubernetes.io/name: {{ include "greenroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "greenroom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "greenroom.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
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

{{/* The seed flags and greenroom train's own, as a YAML list of strings. */}}
{{- define "greenroom.trainArgs" -}}
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
{{- if $v.streamOptimizerState.toDisk }}
- --stream-optimizer-state-to-disk
- --stream-optimizer-state-moment-dtype
- {{ $v.streamOptimizerState.momentDtype | quote }}
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
{{- define "greenroom.trainerCommand" -}}
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
{{- include "greenroom.trainArgs" . | nindent 2 }}
{{- else }}
command:
{{- include "greenroom.trainArgs" . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The init container's script. It runs as root (chown needs it) with env
GREENROOM_NODE_ROOT (the whole node root), GREENROOM_POD_UID and the trainer's uid/gid.
reclaim exits 1 when some dir could not be removed (reported above): that must not keep
this pod from starting; any other failure (a root that is not a dir, exit 2) does.
*/}}
{{- define "greenroom.initScript" -}}
set -eu
rc=0
greenroom reclaim "$GREENROOM_NODE_ROOT" --min-age "$GREENROOM_RECLAIM_MIN_AGE" || rc=$?
if [ "$rc" -gt 1 ]; then exit "$rc"; fi
own="$GREENROOM_NODE_ROOT/$GREENROOM_POD_UID"
mkdir -p "$own"
chown "$GREENROOM_TRAINER_UID:$GREENROOM_TRAINER_GID" "$own"
chmod 0700 "$own"
echo "greenroom-init: $own ready for uid $GREENROOM_TRAINER_UID"
{{- end -}}

{{/*
The preStop hook: reclaims the pod's own dir (the trainer's --offload-train-disk-dir).
Ranks still running hold their locks and are kept: they remove their own dirs on the
SIGTERM that follows. Never fails the hook (a failed hook only delays termination).
*/}}
{{- define "greenroom.preStopScript" -}}
greenroom reclaim "$GREENROOM_DISK_DIR" || true
{{- end -}}

{{/* The pod template shared by the Job and the JobSet. */}}
{{- define "greenroom.podTemplate" -}}
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
    - name: prepare-offload-dir
      image: {{ include "greenroom.image" . }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command: ["/bin/sh", "-c"]
      args:
        - |
          {{- include "greenroom.initScript" . | nindent 10 }}
      env:
        - name: GREENROOM_NODE_ROOT
          value: {{ include "greenroom.nodeRootMount" . | quote }}
        - name: GREENROOM_RECLAIM_MIN_AGE
          value: {{ $v.reclaim.initContainer.minAgeSeconds | quote }}
        - name: GREENROOM_TRAINER_UID
          value: {{ $v.podSecurityContext.runAsUser | default 1000 | quote }}
        - name: GREENROOM_TRAINER_GID
          value: {{ $v.podSecurityContext.runAsGroup | default 1000 | quote }}
        - name: GREENROOM_POD_UID
          valueFrom: {fieldRef: {fieldPath: metadata.uid}}
      # Root only here, and only the capabilities chown/chmod of another user's dir and
      # deleting dead ranks' files need.
      securityContext:
        runAsNonRoot: false
        runAsUser: 0
        runAsGroup: 0
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: [ALL]
          add: [CHOWN, DAC_OVERRIDE, FOWNER]
      {{- with $v.reclaim.initContainer.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: offload
          mountPath: {{ include "greenroom.nodeRootMount" . }}
  {{- end }}
  containers:
    - name: trainer
      image: {{ include "greenroom.image" . }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- include "greenroom.trainerCommand" . | trim | nindent 6 }}
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
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $v.gpu.count $v.resources }}
      resources:
        {{- $res := deepCopy (default (dict) $v.resources) -}}
        {{- if $v.gpu.count -}}
        {{- $limits := default (dict) $res.limits -}}
        {{- $_ := set $limits $v.gpu.resourceName (int $v.gpu.count) -}}
        {{- $_ := set $res "limits" $limits -}}
        {{- end }}
        {{- toYaml $res | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      {{- if $v.reclaim.preStop.enabled }}
      lifecycle:
        preStop:
          exec:
            command:
              - /bin/sh
              - -c
              - {{ include "greenroom.preStopScript" . | quote }}
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
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
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
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The Job spec shared by the Job and the JobSet's replicated job. */}}
{{- define "greenroom.jobSpec" -}}
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
  {{- include "greenroom.podTemplate" . | nindent 2 }}
{{- end -}}
