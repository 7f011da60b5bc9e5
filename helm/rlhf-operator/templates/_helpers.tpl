{{- define "rlhf-operator.fullname" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rlhf-operator.labels" -}}
app.kubernetes.io/name: rlhf-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "rlhf-operator.selector" -}}
app.kubernetes.io/name: rlhf-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
