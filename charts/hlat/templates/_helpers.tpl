{{/* Names and labels, truncated to 63 characters (the DNS label limit). */}}

{{- define "hlat.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "hlat.fullname" -}}
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

{{- define "hlat.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hlat.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hlat.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "hlat.labels" -}}
helm.sh/chart: {{ include "hlat.chart" . }}
{{ include "hlat.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "hlat.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hlat.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The watched namespaces as a JSON list: operator.watchNamespace is one name, a list, or
empty (every namespace). */}}
{{- define "hlat.watchNamespaces" -}}
{{- $w := .Values.operator.watchNamespace -}}
{{- if kindIs "string" $w -}}
{{- if $w }}{{ list $w | toJson }}{{ else }}[]{{ end -}}
{{- else -}}
{{- $w | default list | toJson -}}
{{- end -}}
{{- end }}
