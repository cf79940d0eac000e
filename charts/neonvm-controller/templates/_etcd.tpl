{{/*
The locks' etcd: rules JSON Schema cannot express (docs/chart.md, "The locks' etcd").
Unless etcd.insecure, the controller must prove itself to etcd: a client certificate,
or etcd's user/password authentication over TLS.
*/}}
{{- define "neonvm-controller.validateEtcd" -}}
{{- $etcd := .Values.etcd }}
{{- if not $etcd.insecure }}
{{- if not $etcd.tls.enabled }}
{{- fail "etcd.tls.enabled is off: the locks' etcd must be spoken to over TLS with client credentials; set etcd.insecure=true only for a throwaway test cluster" }}
{{- end }}
{{- if and (or (empty $etcd.tls.certKey) (empty $etcd.tls.keyKey)) (not $etcd.auth.enabled) }}
{{- fail "etcd: no client credentials (etcd.tls.certKey/keyKey empty and etcd.auth off): anyone who reaches etcd could rewrite the locks; give a client certificate, or set etcd.insecure=true for a test cluster" }}
{{- end }}
{{- end }}
{{- if and $etcd.networkPolicy.enabled (empty $etcd.networkPolicy.etcdPodSelector) }}
{{- fail "etcd.networkPolicy.etcdPodSelector is empty: it must name the labels of the etcd pods (an empty selector would select every pod of the namespace)" }}
{{- end }}
{{- end }}

{{/* The namespace of the etcd pods the NetworkPolicy protects. */}}
{{- define "neonvm-controller.etcdNamespace" -}}
{{- .Values.etcd.networkPolicy.etcdNamespace | default .Release.Namespace }}
{{- end }}
