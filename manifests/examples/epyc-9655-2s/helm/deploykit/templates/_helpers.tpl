{{/*
Names, labels and checks shared by every template. Conventions follow bitnami's common helpers: names cut to 63
characters (the DNS label limit), the recommended app.kubernetes.io/* labels plus helm.sh/chart, and selector
labels kept to the stable subset (a selector can never change after the first install).
*/}}

{{- define "deploykit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "deploykit.fullname" -}}
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

{{- define "deploykit.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable for the life of a release. */}}
{{- define "deploykit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deploykit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deploykit.labels" -}}
helm.sh/chart: {{ include "deploykit.chart" . }}
{{ include "deploykit.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Values.managedBy | default .Release.Service }}
app.kubernetes.io/part-of: deploykit
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The engine pods of every slot (what the Service, PDB and NetworkPolicy select). */}}
{{- define "deploykit.engineSelectorLabels" -}}
{{ include "deploykit.selectorLabels" . }}
app.kubernetes.io/component: engine
{{- end }}

{{/* Workload name of one slot: "<fullname>-<slot>" cut to 63 characters. Call with (dict "root" $ "slot" $slot). */}}
{{- define "deploykit.slotName" -}}
{{- $full := include "deploykit.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len (toString .slot.name))))) (toString .slot.name) | trimSuffix "-" }}
{{- end }}

{{/* The cluster DNS pods, as a NetworkPolicyPeer list entry. */}}
{{- define "deploykit.dnsPeer" -}}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ .Values.networkPolicy.dns.namespace }}
  podSelector:
    matchLabels:
      {{- toYaml .Values.networkPolicy.dns.podLabels | nindent 6 }}
{{- end }}

{{- define "deploykit.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}
{{- end }}

{{/* Physical cores a slot leaves to the kubelet: its own coresLeftToKubelet, else placement.coresLeftToKubelet. */}}
{{- define "deploykit.slotLeft" -}}
{{- if hasKey .slot "coresLeftToKubelet" }}{{ int .slot.coresLeftToKubelet }}{{ else }}{{ int .root.Values.placement.coresLeftToKubelet }}{{ end }}
{{- end }}

{{/* Logical CPUs a slot's pod requests: whole physical cores (full-pcpus-only admits nothing else). */}}
{{- define "deploykit.slotCpus" -}}
{{- mul (sub (int .slot.cores) (int (include "deploykit.slotLeft" .))) (int .root.Values.placement.threadsPerCore) }}
{{- end }}

{{- define "deploykit.resources" -}}
cpu: {{ include "deploykit.slotCpus" . | quote }}
memory: {{ .slot.memory | quote }}
{{- if .root.Values.hugepages.enabled }}
hugepages-{{ .root.Values.hugepages.pageSize }}: {{ .root.Values.hugepages.amount | quote }}
{{- end }}
{{- end }}

{{- define "deploykit.seccompProfilePath" -}}
{{- if .Values.seccomp.localhostProfile }}
{{- .Values.seccomp.localhostProfile }}
{{- else if .Values.seccomp.securityProfilesOperator.enabled }}
{{- printf "operator/%s.json" (include "deploykit.fullname" .) }}
{{- else }}
{{- print "deploykit/engine.json" }}
{{- end }}
{{- end }}

{{- define "deploykit.seccompProfile" -}}
{{- if eq .Values.seccomp.type "Localhost" }}
type: Localhost
localhostProfile: {{ include "deploykit.seccompProfilePath" . }}
{{- else }}
type: {{ .Values.seccomp.type }}
{{- end }}
{{- end }}

{{/*
Every problem the schema cannot express, collected and reported at once (a user fixes them in one pass).
*/}}
{{- define "deploykit.validateValues" -}}
{{- $errors := list }}
{{- $v := .Values }}
{{- if and (eq $v.image.tag "latest") (not $v.image.digest) }}
{{- $errors = append $errors "image.tag: \"latest\" moves under a running release; pin a version or set image.digest" }}
{{- end }}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) }}
{{- $errors = append $errors "model.pvc.claimName: required with model.source=pvc (an existing claim holding the model)" }}
{{- end }}
{{- if and (eq $v.model.source "hostPath") (not $v.model.hostPath.path) }}
{{- $errors = append $errors "model.hostPath.path: required with model.source=hostPath" }}
{{- end }}
{{- if and (eq $v.model.source "image") (not $v.model.image.reference) }}
{{- $errors = append $errors "model.image.reference: required with model.source=image (an OCI image holding the model)" }}
{{- end }}
{{- $names := dict }}
{{- range $i, $slot := $v.placement.slots }}
{{- $left := int (include "deploykit.slotLeft" (dict "root" $ "slot" $slot)) }}
{{- $cores := sub (int $slot.cores) $left }}
{{- if lt $cores 1 }}
{{- $errors = append $errors (printf "placement.slots[%d].cores: %v minus coresLeftToKubelet %v leaves no core" $i $slot.cores $left) }}
{{- else if and (not (kindIs "invalid" $v.binding.reservedCpus)) (ge (int $v.binding.reservedCpus) $cores) }}
{{- $errors = append $errors (printf "binding.reservedCpus: %v leaves no core for inference in slot %v (%d cores requested)" $v.binding.reservedCpus $slot.name $cores) }}
{{- end }}
{{- if hasKey $names (toString $slot.name) }}
{{- $errors = append $errors (printf "placement.slots[%d].name: %q is used twice" $i (toString $slot.name)) }}
{{- end }}
{{- $_ := set $names (toString $slot.name) true }}
{{- end }}
{{- if and $v.hugepages.enabled (not $v.hugepages.amount) }}
{{- $errors = append $errors "hugepages.amount: required when hugepages.enabled (e.g. 16Gi)" }}
{{- end }}
{{- if and $v.autoscaling.enabled (gt (int $v.autoscaling.minReplicas) (int $v.autoscaling.maxReplicas)) }}
{{- $errors = append $errors "autoscaling.minReplicas: larger than autoscaling.maxReplicas" }}
{{- end }}
{{- if and $v.seccomp.localhostProfile (ne $v.seccomp.type "Localhost") }}
{{- $errors = append $errors "seccomp.localhostProfile: only used with seccomp.type=Localhost; remove it or set the type" }}
{{- end }}
{{- if and $v.namespace.create (eq $v.namespace.podSecurity "restricted") $v.security.sysNice }}
{{- $errors = append $errors "security.sysNice: CAP_SYS_NICE fails Pod Security \"restricted\" (and baseline): the namespace would reject every pod; drop it (the Localhost profile binds memory without it) or set namespace.podSecurity=privileged" }}
{{- end }}
{{- if and $v.namespace.create (ne $v.namespace.podSecurity "privileged") (eq $v.seccomp.type "Unconfined") }}
{{- $errors = append $errors (printf "seccomp.type: Unconfined fails Pod Security %q: the namespace would reject every pod; use Localhost or set namespace.podSecurity=privileged" $v.namespace.podSecurity) }}
{{- end }}
{{- if and $v.namespace.create (eq $v.namespace.podSecurity "baseline") $v.security.sysNice }}
{{- $errors = append $errors "security.sysNice: CAP_SYS_NICE fails Pod Security \"baseline\": set namespace.podSecurity=privileged or drop it" }}
{{- end }}
{{- if eq (int $v.metrics.port) (int $v.engine.port) }}
{{- $errors = append $errors (printf "metrics.port: %v is engine.port too; the metrics listener needs a port of its own" $v.metrics.port) }}
{{- end }}
{{- if and $v.networkPolicy.enabled $v.metrics.serviceMonitor.enabled (not $v.networkPolicy.metricsNamespace) }}
{{- $errors = append $errors "networkPolicy.metricsNamespace: required with metrics.serviceMonitor.enabled (the namespace Prometheus runs in); the NetworkPolicy would refuse its scrapes" }}
{{- end }}
{{- if $errors }}
{{- fail (printf "\n\ndeploykit chart: %d problem(s) in the values:\n  - %s\n" (len $errors) (join "\n  - " $errors)) }}
{{- end }}
{{- end }}
