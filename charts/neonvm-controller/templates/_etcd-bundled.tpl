{{/*
The bundled etcd (etcd.bundled; docs/chart.md, "The bundled etcd"): names, labels, the
members' URLs, and the rules that tie it to the controller's etcd values.
*/}}

{{- define "neonvm-controller.etcdName" -}}
{{- .Values.etcd.bundled.name | default "neonvm-etcd" }}
{{- end }}

{{/* The pods' selector: the NetworkPolicy's etcdPodSelector must be a subset of it. */}}
{{- define "neonvm-controller.etcdSelectorLabels" -}}
app.kubernetes.io/name: {{ include "neonvm-controller.etcdName" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "neonvm-controller.etcdLabels" -}}
helm.sh/chart: {{ include "neonvm-controller.chart" . }}
{{ include "neonvm-controller.etcdSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.etcd.bundled.image.tag | default "unknown" | quote }}
app.kubernetes.io/component: etcd
app.kubernetes.io/part-of: neonvm
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "neonvm-controller.etcdImage" -}}
{{- $i := .Values.etcd.bundled.image }}
{{- if $i.digest }}
{{- printf "%s@%s" $i.repository $i.digest }}
{{- else }}
{{- printf "%s:%s" $i.repository $i.tag }}
{{- end }}
{{- end }}

{{/* The headless Service the members find each other by (publishes not-ready pods). */}}
{{- define "neonvm-controller.etcdPeerService" -}}
{{- printf "%s-headless" (include "neonvm-controller.etcdName" .) }}
{{- end }}

{{/* <peer service>.<namespace>.svc.<cluster domain>: a member is <pod>.<this>. */}}
{{- define "neonvm-controller.etcdPeerDomain" -}}
{{- printf "%s.%s.svc.%s" (include "neonvm-controller.etcdPeerService" .) .Release.Namespace .Values.etcd.bundled.clusterDomain }}
{{- end }}

{{- define "neonvm-controller.etcdInitialCluster" -}}
{{- $name := include "neonvm-controller.etcdName" . }}
{{- $domain := include "neonvm-controller.etcdPeerDomain" . }}
{{- $members := list }}
{{- $peer := int .Values.etcd.networkPolicy.peerPort }}
{{- range $i := until (int .Values.etcd.bundled.replicas) }}
{{- $members = append $members (printf "%s-%d=https://%s-%d.%s:%d" $name $i $name $i $domain $peer) }}
{{- end }}
{{- join "," $members }}
{{- end }}

{{/*
With the bundled etcd on, the controller's etcd values must name it (the defaults do):
every endpoint its Service or a member (at etcd.networkPolicy.clientPort, which it
listens on), TLS with the client Secret the chart writes (or
you provide, with certificates.generate off), and the NetworkPolicy guarding its pods.
Fails the render with the value to change otherwise.
*/}}
{{- define "neonvm-controller.validateBundledEtcd" -}}
{{- /* The controller's own rules first: their reasons are the more basic ones. */}}
{{- include "neonvm-controller.validate" . }}
{{- include "neonvm-controller.validateEtcd" . }}
{{- $etcd := .Values.etcd }}
{{- $b := $etcd.bundled }}
{{- if $b.enabled }}
{{- $name := include "neonvm-controller.etcdName" . }}
{{- $ns := .Release.Namespace }}
{{- if or $etcd.insecure (not $etcd.tls.enabled) }}
{{- fail "etcd.bundled speaks TLS only: with etcd.insecure or etcd.tls.enabled=false set etcd.bundled.enabled=false and name your own etcd" }}
{{- end }}
{{- $host := printf "^https://(%s|%s-[0-9]+\\.%s-headless)(\\.%s(\\.svc(\\.%s)?)?)?:[0-9]+$" $name $name $name $ns (.Values.etcd.bundled.clusterDomain | replace "." "\\.") }}
{{- range $etcd.endpoints }}
{{- if not (regexMatch $host .) }}
{{- fail (printf "etcd.bundled is on but etcd.endpoints names %s, not the bundled etcd (https://%s:2379): set etcd.bundled.enabled=false to use another etcd" . $name) }}
{{- end }}
{{- end }}
{{- $client := printf "%s-client" $name }}
{{- if ne $etcd.tls.secretName $client }}
{{- fail (printf "etcd.bundled is on: etcd.tls.secretName must be %s (its client certificate), not %s" $client $etcd.tls.secretName) }}
{{- end }}
{{- if or (ne $etcd.tls.caKey "ca.crt") (ne $etcd.tls.certKey "tls.crt") (ne $etcd.tls.keyKey "tls.key") }}
{{- fail "etcd.bundled is on: etcd.tls.caKey/certKey/keyKey must be ca.crt/tls.crt/tls.key (the client Secret's keys; the bundled etcd requires a client certificate)" }}
{{- end }}
{{- if $etcd.auth.enabled }}
{{- fail "etcd.bundled does not turn on etcd's user/password auth: set etcd.auth.enabled=false (the client certificate proves the controller)" }}
{{- end }}
{{- $np := $etcd.networkPolicy }}
{{- if $np.enabled }}
{{- $labels := include "neonvm-controller.etcdSelectorLabels" . | fromYaml }}
{{- range $k, $v := $np.etcdPodSelector }}
{{- if ne (toString (index $labels $k)) (toString $v) }}
{{- fail (printf "etcd.networkPolicy.etcdPodSelector has %s=%v, which the bundled etcd's pods do not carry (%s): the policy would guard nothing" $k $v (toJson $labels)) }}
{{- end }}
{{- end }}
{{- if and $np.etcdNamespace (ne $np.etcdNamespace $ns) }}
{{- fail "etcd.networkPolicy.etcdNamespace must be empty (the release namespace) with etcd.bundled on" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
