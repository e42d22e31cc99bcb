{{/* The chart's name: app.kubernetes.io/name of every object. */}}
{{- define "gpu-node-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The name of the objects: <release>-<chart>, or the release name when it contains the chart's. */}}
{{- define "gpu-node-agent.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "gpu-node-agent.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The namespace of every namespaced object. */}}
{{- define "gpu-node-agent.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride }}
{{- end }}

{{/* The ServiceAccount, as the API server names its requests (the admission policy matches it). */}}
{{- define "gpu-node-agent.username" -}}
{{- printf "system:serviceaccount:%s:%s" (include "gpu-node-agent.namespace" .) (include "gpu-node-agent.fullname" .) }}
{{- end }}

{{/* Labels of the pods, and the DaemonSet's selector: the kustomize base's, so that the chart can
take over a DaemonSet the base created (a selector cannot change) without rolling its pods. */}}
{{- define "gpu-node-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-node-agent.name" . }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "gpu-node-agent.labels" -}}
{{ include "gpu-node-agent.selectorLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The image reference: repository@digest, else repository:tag (the appVersion by default). */}}
{{- define "gpu-node-agent.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* A YAML file from a map, `version` first, as people write these files. */}}
{{- define "gpu-node-agent.versionFirst" -}}
{{- $parts := list }}
{{- if hasKey . "version" }}
{{- $parts = append $parts (dict "version" .version | toYaml) }}
{{- end }}
{{- $rest := omit . "version" }}
{{- if $rest }}
{{- $parts = append $parts (toYaml $rest) }}
{{- end }}
{{- join "\n" $parts }}
{{- end }}

{{/* The existing ConfigMap of named configs: config.existingConfigMap, or config.name as NVIDIA's
device-plugin chart calls it. */}}
{{- define "gpu-node-agent.existingConfigMap" -}}
{{- default .Values.config.name .Values.config.existingConfigMap }}
{{- end }}

{{/* True (non-empty) when the agent reads a directory of named configs rather than one file. */}}
{{- define "gpu-node-agent.namedConfigs" -}}
{{- if or .Values.config.map (include "gpu-node-agent.existingConfigMap" .) }}true{{ end }}
{{- end }}

{{/* The ConfigMap holding the agent's config(s). */}}
{{- define "gpu-node-agent.configMapName" -}}
{{- default (printf "%s-config" (include "gpu-node-agent.fullname" .)) (include "gpu-node-agent.existingConfigMap" .) }}
{{- end }}

{{/* The ConfigMap holding the MIG layouts, and its key. */}}
{{- define "gpu-node-agent.migConfigMapName" -}}
{{- default (printf "%s-mig-layouts" (include "gpu-node-agent.fullname" .)) .Values.mig.existingConfigMap }}
{{- end }}
{{- define "gpu-node-agent.migConfigMapKey" -}}
{{- if .Values.mig.existingConfigMap }}{{ .Values.mig.existingConfigMapKey }}{{ else }}mig-layouts.yaml{{ end }}
{{- end }}

{{/* Values that contradict each other: one line naming them, and nothing rendered. */}}
{{- define "gpu-node-agent.validate" -}}
{{- $map := .Values.config.map | default dict }}
{{- if and .Values.config.name .Values.config.existingConfigMap (ne .Values.config.name .Values.config.existingConfigMap) }}
{{- fail (printf "config.name (%s) and config.existingConfigMap (%s) name different ConfigMaps: set one of them" .Values.config.name .Values.config.existingConfigMap) }}
{{- end }}
{{- if and $map (include "gpu-node-agent.existingConfigMap" .) }}
{{- fail "config.map and config.existingConfigMap are both set: give the named configs in one of them" }}
{{- end }}
{{- if and (gt (len $map) 1) (not (hasKey $map "default")) }}
{{- fail (printf "config.map: %d configs and none named default, which nodes without the nvidia.com/device-plugin.config label use" (len $map)) }}
{{- end }}
{{- range $name, $config := $map }}
{{- if not (or (kindIs "map" $config) (kindIs "string" $config)) }}
{{- fail (printf "config.map.%s: got %s; expected a config, as a map or as the text of a file" $name (kindOf $config)) }}
{{- end }}
{{- end }}
{{- $layouts := .Values.mig.layouts | default dict }}
{{- if and $layouts .Values.mig.existingConfigMap }}
{{- fail "mig.layouts and mig.existingConfigMap are both set: give the MIG layouts in one of them" }}
{{- end }}
{{- if and $layouts (not (hasKey $layouts "mig-configs")) }}
{{- fail "mig.layouts: no mig-configs key; expected a mig-parted v1 file: {version: v1, mig-configs: {<name>: [...]}}" }}
{{- end }}
{{- end }}
