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

{{- /* The trainer image of jobs that name none, for a device (cpu, cuda): called with (list $ device). */ -}}
{{- define "rlhf-operator.trainerImage" -}}
{{- $root := index . 0 -}}
{{- printf "%s:%s-%s" $root.Values.trainer.repository ($root.Values.trainer.tag | default $root.Chart.AppVersion) (index . 1) -}}
{{- end -}}

{{- /* The values' affinity; with replicas > 1, replicas preferably on different nodes (unless the
values set a podAntiAffinity): a node's loss then costs the leader or a standby, not both. */ -}}
{{- define "rlhf-operator.affinity" -}}
{{- $affinity := deepCopy .Values.affinity -}}
{{- if and (gt (int .Values.replicas) 1) (not (hasKey $affinity "podAntiAffinity")) -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "rlhf-operator.selector" . | fromYaml)) -}}
{{- $_ := set $affinity "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" $term))) -}}
{{- end -}}
{{- toYaml $affinity -}}
{{- end -}}
