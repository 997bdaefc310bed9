{{/*
What the schema does not say (it checks each value's type and range alone), refused the
way `greenroom slurm` refuses it: one line naming the values and the fix (helm prints a
template's fail as one line; a schema rule's message would come wrapped in its own
"allOf failed ... missing property" lines). Included once, from the Job template.
*/}}
{{- define "greenroom.validate" -}}
{{- $v := .Values -}}
{{- $o := $v.offload -}}
{{- $st := $v.streamOptimizerState -}}
{{- if and $o.train (eq (toString $o.target) "cpu") $st.toDisk -}}
{{- fail "streamOptimizerState.toDisk with offload.train needs offload.target disk: a run that cannot hold its optimizer state on the GPU will not hold a pinned host copy of the whole actor" -}}
{{- end -}}
{{- if and (eq (toString $o.target) "disk") (not $o.train) -}}
{{- fail "offload.target disk requires offload.train: set offload.train true (or drop offload.target disk); greenroom train refuses --offload-train-target disk without --offload-train" -}}
{{- end -}}
{{- if and (has (toString $o.diskCompression) (list "nvcomp-ans" "zstd")) (lt (int $o.diskChunkMb) 4) -}}
{{- fail "offload.diskCompression nvcomp-ans or zstd needs offload.diskChunkMb 4 or more (one-MiB frames in each staging buffer; greenroom train exits 2 otherwise): raise offload.diskChunkMb, or use offload.diskCompression auto or none" -}}
{{- end -}}
{{- if and (not $st.toDisk) (gt (float64 (default 0 $st.hostCacheGb)) 0.0) -}}
{{- fail "streamOptimizerState.hostCacheGb needs streamOptimizerState.toDisk: the host cache keeps buckets of the streamed state" -}}
{{- end -}}
{{- if and (not $st.toDisk) (eq (toString $st.masterLayout) "fp32") -}}
{{- fail "streamOptimizerState.masterLayout fp32 needs streamOptimizerState.toDisk: it lays out streamed masters" -}}
{{- end -}}
{{- $s := $v.storage -}}
{{- if and (eq $s.mode "pvc") (not $s.pvc.claimName) -}}
{{- fail "storage.pvc.claimName is needed with storage.mode pvc: name an existing PersistentVolumeClaim (or use storage.mode ephemeral for a volume per pod)" -}}
{{- end -}}
{{- with $s.emptyDir.medium -}}
{{- fail (printf "storage.emptyDir.medium %s is refused: a Memory (tmpfs) emptyDir would keep the offloaded state in RAM, counted against the pod's memory limit, which defeats offloading; leave medium \"\" (disk-backed, where the kubelet's root is on NVMe) or use storage.mode hostPath" (toString .)) -}}
{{- end -}}
{{- if and (not $v.command) $v.args -}}
{{- fail "args are the arguments of command and need it: set command (your trainer, with its interpreter), or pass the arguments of greenroom train in train.extraArgs" -}}
{{- end -}}
{{- $t := $v.train -}}
{{- if and $v.command (or $t.extraArgs $t.save $t.load (not (kindIs "invalid" $t.iterations))) -}}
{{- fail "train.iterations, train.save, train.load and train.extraArgs configure greenroom train, which command replaces: give the arguments of your trainer in args, or leave command empty to run greenroom train" -}}
{{- end -}}
{{- if and (not $v.torchrun.enabled) $v.torchrun.extraArgs -}}
{{- fail "torchrun.extraArgs are arguments of torchrun and need torchrun.enabled true: enable torchrun, or drop them (without torchrun they would go nowhere)" -}}
{{- end -}}
{{- $gang := $v.gang.scheduler -}}
{{- if and (eq (toString $v.schedulerName) "volcano") (ne $gang "volcano") (gt (int $v.nodes) 1) -}}
{{- fail (printf "schedulerName volcano without gang.scheduler volcano: Volcano would place the %d pods one by one, and a partly placed job holds GPUs while its first pods wait in the rendezvous; set gang.scheduler volcano (a PodGroup with minMember %d)" (int $v.nodes) (int $v.nodes)) -}}
{{- end -}}
{{- if and (eq $gang "coscheduling") (not $v.schedulerName) -}}
{{- fail "gang.scheduler coscheduling needs schedulerName: the scheduler profile that runs the coscheduling plugin (scheduler-plugins' chart installs it as scheduler-plugins-scheduler); the default scheduler would place the pods one by one" -}}
{{- end -}}
{{- if and (eq $gang "volcano") (eq (toString $v.schedulerName) "default-scheduler") -}}
{{- fail "gang.scheduler volcano with schedulerName default-scheduler: the default scheduler ignores Volcano's PodGroup; leave schedulerName empty (volcano) or give Volcano's scheduler name" -}}
{{- end -}}
{{- if and (eq $gang "kueue") (not $v.gang.queue) -}}
{{- fail "gang.scheduler kueue needs gang.queue: the LocalQueue of the namespace that admits the job (kueue.x-k8s.io/queue-name)" -}}
{{- end -}}
{{- if and (eq $gang "kueue") (hasKey (default (dict) $v.jobLabels) "kueue.x-k8s.io/queue-name") -}}
{{- fail "jobLabels kueue.x-k8s.io/queue-name beside gang.scheduler kueue: name the LocalQueue once, in gang.queue" -}}
{{- end -}}
{{- if and (eq $gang "coscheduling") (hasKey (default (dict) $v.podLabels) "scheduling.x-k8s.io/pod-group") -}}
{{- fail "podLabels scheduling.x-k8s.io/pod-group beside gang.scheduler coscheduling: the chart names the pods' PodGroup itself; drop the label" -}}
{{- end -}}
{{- if and (eq $gang "volcano") (hasKey (default (dict) $v.podAnnotations) "scheduling.k8s.io/group-name") -}}
{{- fail "podAnnotations scheduling.k8s.io/group-name beside gang.scheduler volcano: the chart names the pods' PodGroup itself; drop the annotation" -}}
{{- end -}}
{{- if and $v.gang.queue (not (has $gang (list "volcano" "kueue"))) -}}
{{- fail (printf "gang.queue %s needs gang.scheduler volcano or kueue (a queue of neither would go nowhere)" (toString $v.gang.queue)) -}}
{{- end -}}
{{- range $key := list "jobLabels" "podLabels" -}}
{{- range $label := list "helm.sh/chart" "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" "app.kubernetes.io/version" "app.kubernetes.io/managed-by" "app.kubernetes.io/part-of" -}}
{{- if hasKey (default (dict) (index $v $key)) $label -}}
{{- fail (printf "%s: %s is a label the chart sets (helm.sh/chart, app.kubernetes.io/name, instance, component, version, managed-by, part-of) and may not be set here: the name, instance and component select the trainer pods (the rendezvous Service, onePodPerNode's anti-affinity), and a second value of one renders a duplicate key; use a key of your own" $key $label) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.gpu.count (gt (int $v.procsPerNode) (int $v.gpu.count)) -}}
{{- fail (printf "procsPerNode %d > gpu.count %d: each process needs its own GPU; use at most one process per GPU" (int $v.procsPerNode) (int $v.gpu.count)) -}}
{{- end -}}
{{- if and (not $v.command) (gt (int $v.gpu.count) (int $v.procsPerNode)) -}}
{{- fail (printf "gpu.count %d with procsPerNode %d: greenroom train uses one GPU per process, so %d of each pod's GPUs would sit idle; set procsPerNode %d (torchrun starts one process per GPU) or gpu.count %d" (int $v.gpu.count) (int $v.procsPerNode) (sub (int $v.gpu.count) (int $v.procsPerNode)) (int $v.gpu.count) (int $v.procsPerNode)) -}}
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
