{{/* Chart name, truncated to the 63 characters a label value may have. */}}
{{- define "tokenmill.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, with the chart name unless the release name already contains it. */}}
{{- define "tokenmill.fullname" -}}
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

{{- define "tokenmill.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object. The operator's children carry app.kubernetes.io/name=tokenmill too, told apart by
app.kubernetes.io/component (server, runner); the chart's objects are component=operator.
*/}}
{{- define "tokenmill.labels" -}}
helm.sh/chart: {{ include "tokenmill.chart" . }}
{{ include "tokenmill.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tokenmill
{{- end }}

{{/* Immutable selector labels of the operator (no version, no helm.sh/chart). */}}
{{- define "tokenmill.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tokenmill.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Annotations of every templated object: the Argo CD sync wave (values argocd.syncWave); may be empty. */}}
{{- define "tokenmill.annotations" -}}
{{- with .Values.argocd.syncWave -}}
argocd.argoproj.io/sync-wave: {{ . | quote }}
{{- end }}
{{- end }}

{{- define "tokenmill.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tokenmill.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag[@digest]; the tag defaults to the chart's appVersion. */}}
{{- define "tokenmill.imageRef" -}}
{{- $tag := .image.tag | default .chart.AppVersion }}
{{- if .image.digest }}
{{- printf "%s:%s@%s" .image.repository $tag .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{- define "tokenmill.image" -}}
{{- include "tokenmill.imageRef" (dict "image" .Values.image "chart" .Chart) }}
{{- end }}

{{- define "tokenmill.runnerImage" -}}
{{- include "tokenmill.imageRef" (dict "image" .Values.runnerImage "chart" .Chart) }}
{{- end }}

{{/* The PodMonitors' namespaceSelector: every namespace, or the watched ones. */}}
{{- define "tokenmill.watchedNamespaceSelector" -}}
{{- if eq .Values.rbac.scope "namespace" }}
matchNames:
  {{- toYaml .Values.rbac.namespaces | nindent 2 }}
{{- else }}
any: true
{{- end }}
{{- end }}

{{/* Whether the PrometheusRule includes the "tokenmill-runner" group. */}}
{{- define "tokenmill.runnerRules" -}}
{{- if kindIs "bool" .Values.prometheusRule.runnerRules }}
{{- .Values.prometheusRule.runnerRules }}
{{- else }}
{{- .Values.metrics.runners.podMonitor.enabled }}
{{- end }}
{{- end }}
