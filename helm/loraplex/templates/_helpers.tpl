{{/* Chart name, truncated to the 63-character DNS label limit. */}}
{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "loraplex.fullname" -}}
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

{{- define "loraplex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "loraplex.labels" -}}
helm.sh/chart: {{ include "loraplex.chart" . }}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplex
{{- end }}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "loraplex.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Where the two containers meet: the sidecar's socket and the staged-adapter shared memory. */}}
{{- define "loraplex.socketDir" -}}/var/run/loraplex{{- end }}
{{- define "loraplex.cacheAddress" -}}unix:///var/run/loraplex/cache.sock{{- end }}
{{- define "loraplex.shmDir" -}}/var/lib/loraplex/staged{{- end }}
{{- define "loraplex.preloadPath" -}}/etc/loraplex/preload/preload.yaml{{- end }}
{{- define "loraplex.adminTokenPath" -}}/etc/loraplex/admin/{{ .Values.inference.adminToken.key }}{{- end }}
{{- define "loraplex.tenantsPath" -}}/etc/loraplex/tenants/{{ .Values.inference.tenants.key }}{{- end }}
{{- define "loraplex.tlsDir" -}}/etc/loraplex/tls{{- end }}
{{- define "loraplex.stateDir" -}}/var/lib/loraplex/state{{- end }}
{{/* --state-dir (tenants' adapter registrations, docs/tenants.md): whenever tenants are configured,
or a claim is given for it. */}}
{{- define "loraplex.stateEnabled" -}}
{{- if or .Values.inference.tenants.existingSecret .Values.inference.state.existingClaim }}true{{- end }}
{{- end }}
{{- define "loraplex.kernelCacheDir" -}}/var/cache/loraplex/kernels{{- end }}
{{/* Both containers' TCP listeners (gRPC, /metrics) bind every pod address: probes, Services and
Prometheus reach them on the pod IP, kubectl port-forward on localhost. */}}
{{- define "loraplex.bindAddress" -}}0.0.0.0{{- end }}

{{/* --shutdown-grace-s: what the pod's grace period leaves after the preStop sleep and a margin. */}}
{{- define "loraplex.shutdownGraceSeconds" -}}
{{- $d := .Values.inference.drain }}
{{- max 1 (sub (sub (int .Values.terminationGracePeriodSeconds) (int $d.preStopSeconds)) (int $d.marginSeconds)) }}
{{- end }}

{{/* sizeLimit of the staged-adapter emptyDir, in bytes: cache budget plus headroom. */}}
{{- define "loraplex.shmSizeBytes" -}}
{{- $cap := int64 .Values.cache.capacityBytes }}
{{- add $cap (div (mul $cap (int64 .Values.cache.shmHeadroomPercent)) 100) }}
{{- end }}

{{/* Sidecar memory: the tmpfs pages it writes are charged to the pod, so budget for them. */}}
{{- define "loraplex.cacheMemoryBytes" -}}
{{- add (include "loraplex.shmSizeBytes" . | int64) (int64 .Values.cache.processMemoryBytes) }}
{{- end }}

{{- define "loraplex.preloadConfigMap" -}}
{{- default (printf "%s-preload" (include "loraplex.fullname" .)) .Values.preload.existingConfigMap }}
{{- end }}

{{- define "loraplex.preloadEnabled" -}}
{{- if or .Values.preload.existingConfigMap .Values.preload.adapters }}true{{- end }}
{{- end }}

{{/* Container securityContext; pass (dict "root" $ "ipcLock" bool). */}}
{{- define "loraplex.containerSecurityContext" -}}
{{- $sc := deepCopy .root.Values.securityContext }}
{{- if .ipcLock }}
{{- $caps := default dict $sc.capabilities }}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) }}
{{- $_ := set $sc "capabilities" $caps }}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/*
Sidecar health check. The sidecar serves grpc.health.v1 on a Unix socket, which the kubelet's native
gRPC probe cannot dial (it only connects to the pod IP over TCP), and a TCP probe on the metrics port
would only prove the metrics thread is alive. So the probe execs the standard health Check against the
very socket the inference container uses. Cost: one short Python start per probe, hence the longer
periods in values.cache.probes.
*/}}
{{- define "loraplex.cacheHealthCommand" -}}
- python
- -c
- |
  import sys, grpc
  from grpc_health.v1 import health_pb2, health_pb2_grpc
  with grpc.insecure_channel(sys.argv[1]) as ch:
      r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
  sys.exit(0 if r.status == health_pb2.HealthCheckResponse.SERVING else 1)
- {{ include "loraplex.cacheAddress" . }}
{{- end }}

{{/*
Inference probe handler; pass (dict "root" $ "service" NAME): native gRPC (grpc.health.v1). Service
"liveness" is SERVING while the scheduler makes progress (startup, liveness); service "" is SERVING
while the pod should get traffic (readiness: required preloads in, not draining, engine healthy).
The kubelet's gRPC probe speaks plaintext only, so with TLS on it asks the plaintext health-only
port (inference.tls.healthPort, --health-listen) instead of the serving port: a TCP connect there
would pass as soon as the port listens, before the required preloads are in.
*/}}
{{- define "loraplex.inferenceProbeHandler" -}}
grpc:
  port: {{ ternary .root.Values.inference.tls.healthPort .root.Values.inference.grpcPort .root.Values.inference.tls.enabled }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end }}
