{{/*
The content of /etc/k3/config.yaml as JSON, in the shape services/runtime/config.py reads: shared scalars at
the top level, then one section per enabled service.
*/}}
{{- define "k3.configData" -}}
{{- $ports := .Values.ports -}}
{{- $config := dict "host" "0.0.0.0" "port" $ports.grpc "metrics_port" $ports.metrics }}
{{- range $name, $_ := .Values.services }}
{{- $s := include "k3.spec" (list $ $name) | fromJson }}
{{- if $s.enabled }}
{{- $section := dict "drain_grace_s" $s.drainSeconds }}
{{- if eq $name "gateway" }}
{{- $_ := set $section "http_port" $ports.http }}
{{- range $peer := list "router" "admission" }}
{{- if (include "k3.spec" (list $ $peer) | fromJson).enabled }}
{{- $_ := set $section (printf "%s_address" $peer) (printf "%s.%s.svc:%v" (include "k3.componentName" (list $ $peer)) $.Release.Namespace $ports.grpc) }}
{{- end }}
{{- end }}
{{- end }}
{{- $_ := set $config $name (mergeOverwrite $section (deepCopy $s.config)) }}
{{- end }}
{{- end }}
{{- mergeOverwrite (deepCopy .Values.config) $config | toJson -}}
{{- end -}}

{{/* Hash of what one service reads (shared keys + its own section): (list $ name). Other services' changes
     do not restart it (a GPU worker restart means a model reload). */}}
{{- define "k3.configChecksum" -}}
{{- $root := index . 0 -}}
{{- $config := include "k3.configData" $root | fromJson -}}
{{- $shared := dict -}}
{{- range $key, $value := $config -}}
{{- if not (hasKey $root.Values.services $key) -}}{{- $_ := set $shared $key $value -}}{{- end -}}
{{- end -}}
{{- dict "shared" $shared "own" (index $config (index . 1)) | toJson | sha256sum -}}
{{- end -}}
