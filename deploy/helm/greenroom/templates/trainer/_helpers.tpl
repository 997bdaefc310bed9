{{/* The trainer: its command, env and container. The pod and Job are in _pod.tpl. */}}

{{/* The seed's flags, exactly as OffloadFlags.to_argv() writes them (a YAML list). */}}
{{- define "greenroom.trainer.seedFlags" -}}
{{- $v := .Values -}}
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
{{- $layout := $v.streamOptimizerState.masterLayout | default "remainder" }}
{{- if ne $layout "remainder" }}
- --stream-optimizer-state-master-layout
- {{ $layout | quote }}
{{- end }}
{{- if $v.streamOptimizerState.hostCacheGb }}
- --stream-optimizer-state-host-cache-gb
- {{ $v.streamOptimizerState.hostCacheGb | quote }}
{{- end }}
{{- end }}
{{- if $v.noLoadOptim }}
- --no-load-optim
{{- end }}
{{- end -}}

{{/* GREENROOM_ARGS: the seed flags as one shell-quoted string (shlex.join). */}}
{{- define "greenroom.trainer.argsEnv" -}}
{{- $words := list -}}
{{- range (include "greenroom.trainer.seedFlags" . | fromYamlArray) -}}
{{- $words = append $words (include "greenroom.shellWord" (toString .)) -}}
{{- end -}}
{{- join " " $words -}}
{{- end -}}

{{/* The program and its own arguments: `command`/`args`, or greenroom train with train.*.
The schema refuses `args` without `command` and train.* beside it: neither is left out. */}}
{{- define "greenroom.trainer.program" -}}
{{- $v := .Values -}}
{{- if $v.command }}
{{- toYaml $v.command }}
{{- range $v.args }}
- {{ . | quote }}
{{- end }}
{{- else }}
- greenroom
- train
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
{{- with (default $v.train.save $v.train.load) }}
- --load
- {{ . | quote }}
- --resume
- {{ $v.train.resume | quote }}
{{- end }}
{{- range $v.train.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Whether the seed flags are appended to the program's command line. */}}
{{- define "greenroom.trainer.appendFlags" -}}
{{- $mode := .Values.greenroomArgs -}}
{{- if or (eq $mode "append") (and (eq $mode "auto") (not .Values.command)) -}}true{{- end -}}
{{- end -}}

{{/* The whole argv the container runs (launcher, program, flags), as a list. */}}
{{- define "greenroom.trainer.argv" -}}
{{- $v := .Values -}}
{{- $argv := list -}}
{{- if $v.torchrun.enabled -}}
{{- $argv = concat $v.torchrun.command (list
      (printf "--nnodes=%d" (int $v.nodes))
      (printf "--nproc-per-node=%d" (int $v.procsPerNode))
      "--node-rank=$(NODE_RANK)" "--master-addr=$(MASTER_ADDR)" "--master-port=$(MASTER_PORT)"
      (printf "--rdzv-conf=timeout=%d" (int $v.torchrun.rendezvousTimeoutSeconds))) -}}
{{- $argv = concat $argv $v.torchrun.extraArgs (list "--no-python") -}}
{{- end -}}
{{- $argv = concat $argv (include "greenroom.trainer.program" . | fromYamlArray) -}}
{{- if include "greenroom.trainer.appendFlags" . -}}
{{- range (include "greenroom.trainer.seedFlags" . | fromYamlArray) -}}
{{- $argv = append $argv (include "greenroom.k8sLiteral" (toString .)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $argv -}}
{{- end -}}

{{/* command: the launcher (torchrun's, else `command` or greenroom train); args: the rest. */}}
{{- define "greenroom.trainer.command" -}}
{{- $v := .Values -}}
{{- $argv := include "greenroom.trainer.argv" . | fromYamlArray -}}
{{- $head := 2 -}}
{{- if $v.torchrun.enabled }}{{ $head = len $v.torchrun.command }}{{ else if $v.command }}{{ $head = len $v.command }}{{ end -}}
command:
{{- range slice $argv 0 $head }}
  - {{ toString . | quote }}
{{- end }}
args:
{{- range slice $argv $head }}
  - {{ toString . | quote }}
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

{{/* The env every launcher and trainer expects, then greenroom's own, then extraEnv. */}}
{{- define "greenroom.trainer.env" -}}
{{- $v := .Values -}}
- name: NODE_RANK
  valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/job-completion-index']"}}
- name: NNODES
  value: {{ $v.nodes | quote }}
- name: NPROC_PER_NODE
  value: {{ $v.procsPerNode | quote }}
- name: WORLD_SIZE
  value: {{ mul $v.nodes $v.procsPerNode | quote }}
- name: MASTER_ADDR
  value: {{ include "greenroom.masterAddr" . | quote }}
- name: MASTER_PORT
  value: {{ $v.torchrun.port | quote }}
{{- if not $v.torchrun.enabled }}
# One process per pod without torchrun: its rank is the pod's.
- name: RANK
  valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/job-completion-index']"}}
- name: LOCAL_RANK
  value: "0"
{{- end }}
- name: GREENROOM_ARGS
  value: {{ include "greenroom.k8sLiteral" (include "greenroom.trainer.argsEnv" .) | quote }}
- name: GREENROOM_DISK_DIR
  value: {{ include "greenroom.k8sLiteral" $v.storage.mountPath | quote }}
- name: GREENROOM_JOB_ID
  valueFrom: {fieldRef: {fieldPath: "metadata.labels['batch.kubernetes.io/controller-uid']"}}
- name: GREENROOM_POD_UID
  valueFrom: {fieldRef: {fieldPath: metadata.uid}}
- name: GREENROOM_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: GREENROOM_POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: GREENROOM_NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The trainer's resources: `resources` plus the GPU limit, hugepages and, for an
emptyDir, its size as the ephemeral-storage request (so the scheduler places it). */}}
{{- define "greenroom.trainer.resources" -}}
{{- $v := .Values -}}
{{- $res := deepCopy (default (dict) $v.resources) -}}
{{- $limits := default (dict) $res.limits -}}
{{- $requests := default (dict) $res.requests -}}
{{- if $v.gpu.count -}}
{{- $_ := set $limits $v.gpu.resourceName (int $v.gpu.count) -}}
{{- end -}}
{{- if $v.hugepages.size -}}
{{- $_ := set $limits (printf "hugepages-%s" $v.hugepages.size) $v.hugepages.amount -}}
{{- $_ := set $requests (printf "hugepages-%s" $v.hugepages.size) $v.hugepages.amount -}}
{{- end -}}
{{- if and (eq $v.storage.mode "emptyDir") (not (hasKey $requests "ephemeral-storage")) -}}
{{- $_ := set $requests "ephemeral-storage" $v.storage.emptyDir.sizeLimit -}}
{{- end -}}
{{- if $limits }}{{ $_ := set $res "limits" $limits }}{{ end -}}
{{- if $requests }}{{ $_ := set $res "requests" $requests }}{{ end -}}
{{- if $res }}{{ toYaml $res }}{{ end -}}
{{- end -}}

{{/*
The trainer's uid (key "runAsUser") or gid ("runAsGroup") where the values set one: the
container's securityContext wins over the pod's, as in Kubernetes; empty where neither
does (the image's own user runs it). hasKey, not `default`: 0 (root) is a uid, not unset.
*/}}
{{- define "greenroom.trainer.runAsSet" -}}
{{- $key := .key -}}
{{- range (list .ctx.Values.securityContext .ctx.Values.podSecurityContext) -}}
{{- $sc := default (dict) . -}}
{{- if and (not $.found) (hasKey $sc $key) (not (kindIs "invalid" (index $sc $key))) -}}
{{- index $sc $key | int64 -}}
{{- $_ := set $ "found" true -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The trainer's uid or gid: as set, else 1000, the user of greenroom's image
(images/Dockerfile), which the chart's default podSecurityContext also names. */}}
{{- define "greenroom.trainer.runAs" -}}
{{- $set := include "greenroom.trainer.runAsSet" (dict "ctx" .ctx "key" .key) -}}
{{- if ne $set "" }}{{ $set }}{{ else }}1000{{ end -}}
{{- end -}}

{{/* The trainer's securityContext: `securityContext`, plus IPC_LOCK when asked. */}}
{{- define "greenroom.trainer.securityContext" -}}
{{- $sc := deepCopy .Values.securityContext -}}
{{- if .Values.ipcLock -}}
{{- $caps := default (dict) $sc.capabilities -}}
{{- $_ := set $caps "add" (concat (default (list) $caps.add) (list "IPC_LOCK")) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* The trainer container. */}}
{{- define "greenroom.trainer.container" -}}
{{- $v := .Values -}}
- name: trainer
  image: {{ include "greenroom.image" . | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy | quote }}
  {{- include "greenroom.trainer.command" . | nindent 2 }}
  env:
    {{- include "greenroom.trainer.env" . | nindent 4 }}
  {{- with (include "greenroom.trainer.resources" .) }}
  resources:
    {{- . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "greenroom.trainer.securityContext" . | nindent 4 }}
  {{- if $v.reclaim.preStop.enabled }}
  lifecycle:
    preStop:
      exec:
        command:
          - /bin/sh
          - -c
          - {{ include "greenroom.trainer.preStopScript" . | quote }}
  {{- end }}
  {{- if $v.torchrun.enabled }}
  ports:
    - name: rendezvous
      containerPort: {{ $v.torchrun.port }}
  {{- end }}
  volumeMounts:
    - name: offload
      mountPath: {{ $v.storage.mountPath | quote }}
      {{- if eq $v.storage.mode "hostPath" }}
      subPathExpr: $(GREENROOM_POD_UID)
      {{- end }}
    {{- if $v.shmSizeLimit }}
    - name: dshm
      mountPath: /dev/shm
    {{- end }}
    {{- if $v.hugepages.size }}
    - name: hugepages
      mountPath: /dev/hugepages
    {{- end }}
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
