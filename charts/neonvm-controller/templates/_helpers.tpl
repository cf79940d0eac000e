{{/*
Names, labels and derived settings shared by the templates.
*/}}

{{- define "neonvm-controller.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name; cluster-scoped objects (ClusterRole, ClusterRoleBinding, the
admission policy and its binding) carry it, so two releases never share one.
*/}}
{{- define "neonvm-controller.fullname" -}}
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

{{/*
The audience of the projected ServiceAccount token a runner presents for its right
(--rights-audience): one per release, so a token minted for another release's rights (or
for the API server) is refused, and one of this audience is no credential to the API
server (docs/security.md, "Rights endpoint").
*/}}
{{- define "neonvm-controller.rightsAudience" -}}
vm.neon.tech/rights/{{ .Release.Namespace }}/{{ include "neonvm-controller.fullname" . }}
{{- end }}

{{/*
"true" when the leader serves rights (self-fencing): controller.rightSeconds > 0. Runners
ask with a projected ServiceAccount token the leader verifies by a TokenReview, so no
Secret rights are needed (docs/chart.md). "" otherwise.
*/}}
{{- define "neonvm-controller.servesRights" -}}
{{- if gt (float64 .Values.controller.rightSeconds) 0.0 }}true{{- end }}
{{- end }}

{{- define "neonvm-controller.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "neonvm-controller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "neonvm-controller.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The `helm test` pod's labels: not the controller's selector (the Deployment, its PDB
and the metrics Service must not select it); the etcd NetworkPolicy admits them. */}}
{{- define "neonvm-controller.testSelectorLabels" -}}
app.kubernetes.io/name: {{ include "neonvm-controller.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "neonvm-controller.labels" -}}
helm.sh/chart: {{ include "neonvm-controller.chart" . }}
{{ include "neonvm-controller.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: controller
app.kubernetes.io/part-of: neonvm
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "neonvm-controller.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "neonvm-controller.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The user name the API server gives the controller's ServiceAccount: the admission
fence names it as the only identity that may ungate runner pods.
*/}}
{{- define "neonvm-controller.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "neonvm-controller.serviceAccountName" .) }}
{{- end }}

{{- define "neonvm-controller.leaseNamespace" -}}
{{- default .Release.Namespace .Values.leaderElection.namespace }}
{{- end }}

{{- define "neonvm-controller.leaseName" -}}
{{- default (include "neonvm-controller.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* repository:tag (tag "" means appVersion), or repository@digest when a digest is set. */}}
{{- define "neonvm-controller.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Where the etcd TLS Secret is mounted; the NEONVM_ETCD_CA/_CERT/_KEY paths point into it.
*/}}
{{- define "neonvm-controller.etcdTLSDir" -}}
/etc/neonvm/etcd-tls
{{- end }}

{{/*
Settings JSON Schema cannot express (relations between values); fails the render.
*/}}
{{- define "neonvm-controller.validate" -}}
{{- $le := .Values.leaderElection }}
{{- if le (float64 $le.renewDeadlineSeconds) (mulf $le.retryPeriodSeconds 1.2) }}
{{- fail (printf "leaderElection.renewDeadlineSeconds (%v) must exceed 1.2 x retryPeriodSeconds (%v): a renewal retry must fit in the deadline" $le.renewDeadlineSeconds $le.retryPeriodSeconds) }}
{{- end }}
{{- if le (float64 $le.leaseDurationSeconds) (addf $le.renewDeadlineSeconds $le.retryPeriodSeconds) }}
{{- fail (printf "leaderElection.renewDeadlineSeconds (%v) must be below leaseDurationSeconds (%v) minus retryPeriodSeconds (%v): the leader must stop before standbys may take over" $le.renewDeadlineSeconds $le.leaseDurationSeconds $le.retryPeriodSeconds) }}
{{- end }}
{{- $tls := .Values.etcd.tls }}
{{- if $tls.enabled }}
{{- if ne (empty $tls.certKey) (empty $tls.keyKey) }}
{{- fail "etcd.tls.certKey and etcd.tls.keyKey go together: set both (client certificate) or neither" }}
{{- end }}
{{- end }}
{{- end }}
