{{/* The init container: hostPath mode prepares the node-local dir (as root); pvc mode
reclaims the claim as the trainer's uid (restricted). emptyDir and ephemeral have none. */}}

{{/*
The init container's script. It runs as root (chown needs it) with env
GREENROOM_NODE_ROOT (the whole node root), GREENROOM_POD_UID and the trainer's uid/gid.
reclaim exits 1 when some dir could not be removed (reported above): that must not keep
this pod from starting; any other failure (a root that is not a dir, exit 2) does.
The pod's dir, made here, gets greenroom's marker (runtime/greenroom/dirs/tree.py, Note
[made parents]): only a marked dir is ever removed, by reclaim or the janitor. One that
is there already (made by an earlier run of this init container, for the same pod) gets
no second one.
*/}}
{{- define "greenroom.init.script" -}}
set -eu
rc=0
greenroom reclaim "$GREENROOM_NODE_ROOT" --min-age "$GREENROOM_RECLAIM_MIN_AGE" || rc=$?
if [ "$rc" -gt 1 ]; then exit "$rc"; fi
own="$GREENROOM_NODE_ROOT/$GREENROOM_POD_UID"
if [ ! -d "$own" ]; then
  mkdir "$own"
  : > "$own/.greenroom-made"
fi
chown "$GREENROOM_TRAINER_UID:$GREENROOM_TRAINER_GID" "$own"
chmod 0700 "$own"
echo "greenroom-init: $own ready for uid $GREENROOM_TRAINER_UID"
{{- end -}}

{{/* pvc mode: the claim's stale dirs, removed as the trainer's own uid (its files). */}}
{{- define "greenroom.init.pvcScript" -}}
set -eu
rc=0
greenroom reclaim "$GREENROOM_NODE_ROOT" --min-age "$GREENROOM_RECLAIM_MIN_AGE" || rc=$?
if [ "$rc" -gt 1 ]; then exit "$rc"; fi
echo "greenroom-init: reclaimed stale per-rank dirs in the claim"
{{- end -}}

{{/* The init container: reclaims dead ranks' dirs on the node, then makes this pod's own. */}}
{{- define "greenroom.init.container" -}}
{{- $v := .Values -}}
{{- if eq $v.storage.mode "pvc" }}
- name: reclaim-offload-dir
  image: {{ include "greenroom.image" . | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy | quote }}
  command: ["/bin/sh", "-c"]
  args:
    - |
      {{- include "greenroom.init.pvcScript" . | nindent 6 }}
  env:
    - name: GREENROOM_NODE_ROOT
      value: {{ include "greenroom.nodeRootMount" . | quote }}
    - name: GREENROOM_RECLAIM_MIN_AGE
      value: {{ $v.reclaim.initContainer.minAgeSeconds | quote }}
  # The trainer's uid, no capabilities: restricted. Named here where `securityContext`
  # gives the trainer its own (an init container does not get the trainer's).
  securityContext:
    {{- range $key := list "runAsUser" "runAsGroup" }}
    {{- with (include "greenroom.trainer.runAsSet" (dict "ctx" $ "key" $key)) }}
    {{ $key }}: {{ . }}
    {{- end }}
    {{- end }}
    {{- if and $v.securityContext (hasKey $v.securityContext "runAsNonRoot") }}
    runAsNonRoot: {{ $v.securityContext.runAsNonRoot }}
    {{- end }}
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities:
      drop: [ALL]
  {{- with $v.reclaim.initContainer.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: offload
      mountPath: {{ include "greenroom.nodeRootMount" . | quote }}
{{- else }}
- name: prepare-offload-dir
  image: {{ include "greenroom.image" . | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy | quote }}
  command: ["/bin/sh", "-c"]
  args:
    - |
      {{- include "greenroom.init.script" . | nindent 6 }}
  env:
    - name: GREENROOM_NODE_ROOT
      value: {{ include "greenroom.nodeRootMount" . | quote }}
    - name: GREENROOM_RECLAIM_MIN_AGE
      value: {{ $v.reclaim.initContainer.minAgeSeconds | quote }}
    - name: GREENROOM_TRAINER_UID
      value: {{ include "greenroom.trainer.runAs" (dict "ctx" . "key" "runAsUser") | quote }}
    - name: GREENROOM_TRAINER_GID
      value: {{ include "greenroom.trainer.runAs" (dict "ctx" . "key" "runAsGroup") | quote }}
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
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: offload
      mountPath: {{ include "greenroom.nodeRootMount" . | quote }}
{{- end }}
{{- end -}}
