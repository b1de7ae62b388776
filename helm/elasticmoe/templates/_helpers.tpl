{{/* Names and labels. */}}
{{- define "elasticmoe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elasticmoe.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* KubeRay derives the RayCluster (<name>-raycluster-xxxxx) and its Services
(<cluster>-head-svc, <name>-serve-svc) from this name; keep room for the suffixes. */}}
{{- define "elasticmoe.rayServiceName" -}}
{{- include "elasticmoe.fullname" . | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "elasticmoe.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elasticmoe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elasticmoe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "elasticmoe.labels" -}}
helm.sh/chart: {{ include "elasticmoe.chart" . }}
{{ include "elasticmoe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Every pod of this release carries the instance label: the NetworkPolicy's "this release". */}}
{{- define "elasticmoe.releasePodSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "elasticmoe.headSelectorLabels" -}}
{{ include "elasticmoe.selectorLabels" . }}
app.kubernetes.io/component: head
{{- end }}

{{- define "elasticmoe.workerSelectorLabels" -}}
{{ include "elasticmoe.selectorLabels" . }}
app.kubernetes.io/component: device-worker
{{- end }}

{{- define "elasticmoe.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The pod's grace period can never be shorter than preStop sleep + drain + 10 s of slack for
Ray to stop; a smaller terminationGracePeriodSeconds is raised to that. */}}
{{- define "elasticmoe.terminationGracePeriodSeconds" -}}
{{- $minimum := add .Values.drain.preStopSleepSeconds .Values.drain.timeoutSeconds 10 }}
{{- max (int64 .Values.terminationGracePeriodSeconds) $minimum }}
{{- end }}

{{/* Invariants the schema cannot express (they mirror CoordinatorConfig.__post_init__). */}}
{{- define "elasticmoe.validate" -}}
{{- $c := .Values.coordinator }}
{{- $w := .Values.workers }}
{{- $devices := include "elasticmoe.numDevices" . | int64 }}
{{- if gt (int64 $c.dp) $devices }}
{{- fail (printf "coordinator.dp (%v) must be <= the devices of the worker pods at start (%v = workers.replicas x workers.devicesPerPod)" $c.dp $devices) }}
{{- end }}
{{- if or (lt (int64 $w.replicas) (int64 $w.minReplicas)) (gt (int64 $w.replicas) (int64 $w.maxReplicas)) }}
{{- fail "workers: need minReplicas <= replicas <= maxReplicas" }}
{{- end }}
{{- if ge (float64 $c.kv_bytes_per_device) (float64 $c.device_memory_bytes) }}
{{- fail "coordinator.kv_bytes_per_device must be below coordinator.device_memory_bytes" }}
{{- end }}
{{- if gt (len $c.esft_adapters) (int $c.max_esft_adapters) }}
{{- fail "coordinator.esft_adapters: more adapters than coordinator.max_esft_adapters" }}
{{- end }}
{{- if gt (len $c.lora_adapters) (int $c.max_loras) }}
{{- fail "coordinator.lora_adapters: more adapters than coordinator.max_loras" }}
{{- end }}
{{- $a := .Values.autoscale }}
{{- if gt (int64 $a.min_dp) $devices }}
{{- fail "autoscale.min_dp must be <= the devices of the worker pods at start" }}
{{- end }}
{{- if not (kindIs "invalid" $a.max_dp) }}
{{- if gt (int64 $a.min_dp) (int64 $a.max_dp) }}
{{- fail "autoscale.min_dp must be <= autoscale.max_dp" }}
{{- end }}
{{- end }}
{{- if and .Values.auth.existingSecret (or .Values.auth.apiKey .Values.auth.adminKey) }}
{{- fail "auth: set either existingSecret or apiKey/adminKey, not both" }}
{{- end }}
{{- if and (eq .Values.rayAuth.mode "secret") (not .Values.rayAuth.existingSecret) }}
{{- fail "rayAuth.mode secret needs rayAuth.existingSecret (a Secret holding the Ray token)" }}
{{- end }}
{{- if not (kindIs "invalid" $c.max_devices) }}
{{- if lt (int64 $c.max_devices) (int64 $c.dp) }}
{{- fail "coordinator.max_devices must be >= coordinator.dp" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The devices the worker pods offer at start. */}}
{{- define "elasticmoe.numDevices" -}}
{{- mul (int64 .Values.workers.replicas) (int64 .Values.workers.devicesPerPod) }}
{{- end }}

{{/* The worker group may grow and shrink (KubeRay's in-tree autoscaler is on). */}}
{{- define "elasticmoe.workersScale" -}}
{{- if gt (int64 .Values.workers.maxReplicas) (int64 .Values.workers.minReplicas) }}true{{- end }}
{{- end }}

{{/* serveConfigV2 `args`: CoordinatorConfig fields (nulls left out, so the field's default
applies), model_dir from model.path, num_devices from the worker pods, and the autoscaler's mapping. */}}
{{- define "elasticmoe.serveArgs" -}}
{{- $args := dict "model_dir" .Values.model.path "num_devices" (include "elasticmoe.numDevices" . | int64) }}
{{- if include "elasticmoe.workersScale" . }}
{{- $_ := set $args "max_devices" (mul (int64 .Values.workers.maxReplicas) (int64 .Values.workers.devicesPerPod)) }}
{{- $_ := set $args "release_idle_nodes" true }}
{{- end }}
{{- range $key, $value := .Values.coordinator }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $args $key $value }}
{{- end }}
{{- end }}
{{- $autoscale := dict }}
{{- range $key, $value := .Values.autoscale }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $autoscale $key $value }}
{{- end }}
{{- end }}
{{- $_ := set $args "autoscale" $autoscale }}
{{- toYaml $args }}
{{- end }}

{{/* The Serve config: the same text goes into serveConfigV2 and the head's bootstrap ConfigMap. */}}
{{- define "elasticmoe.serveConfig" -}}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: {{ .Values.serve.port }}
applications:
  - name: elasticmoe
    route_prefix: /
    import_path: coordinator.deployment:app_builder
    args:
      {{- include "elasticmoe.serveArgs" . | nindent 6 }}
{{- end }}

{{- define "elasticmoe.authSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- printf "%s-auth" (include "elasticmoe.fullname" .) }}
{{- end }}
{{- end }}

{{/* API keys reach the containers only as secretKeyRef env. */}}
{{- define "elasticmoe.authEnv" -}}
{{- $secret := include "elasticmoe.authSecretName" . }}
{{- if or .Values.auth.existingSecret .Values.auth.apiKey }}
- name: ELASTICMOE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: api-key
{{- end }}
{{- if or .Values.auth.existingSecret .Values.auth.adminKey }}
- name: ELASTICMOE_ADMIN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: admin-key
{{- end }}
{{- end }}

{{/* The Ray token from an existing Secret (rayAuth.mode secret; with mode operator KubeRay sets it). */}}
{{- define "elasticmoe.rayAuthEnv" -}}
{{- if eq .Values.rayAuth.mode "secret" }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.rayAuth.existingSecret }}
      key: {{ .Values.rayAuth.secretKey }}
{{- end }}
{{- end }}

{{/* Env of every Ray container. */}}
{{- define "elasticmoe.env" -}}
- name: PYTHONUNBUFFERED
  value: "1"
{{- /* glibc's malloc at two arenas in every Ray process of the pod (coordinator/launch.py, LOCAL_RAY_DEFAULTS) */}}
- name: MALLOC_ARENA_MAX
  value: "2"
{{- /* OpenMP threads that spin ~0.1 ms when they wait, then sleep: a rank's idle thread leaves the core to the pod's other processes (coordinator/launch.py) */}}
- name: OMP_WAIT_POLICY
  value: PASSIVE
- name: GOMP_SPINCOUNT
  value: "10000"
{{- include "elasticmoe.authEnv" . }}
{{- include "elasticmoe.rayAuthEnv" . }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The model: a read-only PVC, or an emptyDir the initContainer below fills. */}}
{{- define "elasticmoe.modelVolume" -}}
- name: model
{{- if .Values.model.pvc.claimName }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.generate.sizeLimit }}
{{- end }}
{{- end }}

{{- define "elasticmoe.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
{{- if .Values.model.pvc.claimName }}
  readOnly: true
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "elasticmoe.initContainers" -}}
{{- if not .Values.model.pvc.claimName }}
- name: make-model
  image: {{ include "elasticmoe.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - elasticmoe
    - make-model
    - --arch
    - {{ .Values.model.generate.arch | quote }}
    - --preset
    - {{ .Values.model.generate.preset | quote }}
    - --seed
    - {{ .Values.model.generate.seed | quote }}
    - --out
    - {{ .Values.model.path | quote }}
  volumeMounts:
    {{- include "elasticmoe.modelMount" . | nindent 4 }}
  {{- with .Values.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Volumes shared by head and workers; /dev/shm is sized per group. */}}
{{- define "elasticmoe.volumes" -}}
{{- $ctx := index . 0 }}
{{- $shmSizeLimit := index . 1 }}
{{- include "elasticmoe.modelVolume" $ctx }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $shmSizeLimit }}
{{- with $ctx.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "elasticmoe.volumeMounts" -}}
{{- include "elasticmoe.modelMount" . }}
- name: dshm
  mountPath: /dev/shm
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* rayStartParams: values are strings for KubeRay. */}}
{{- define "elasticmoe.rayStartParams" -}}
{{- range $key, $value := . }}
{{ $key }}: {{ $value | toString | quote }}
{{- end }}
{{- end }}
