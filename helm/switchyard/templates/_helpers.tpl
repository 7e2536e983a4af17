{{- define "switchyard.name" -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "switchyard.labels" -}}
app.kubernetes.io/name: switchyard
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "switchyard.selector" -}}
app.kubernetes.io/name: switchyard
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
