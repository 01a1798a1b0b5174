{{/* Release-scoped name prefix, kept under 40 chars so "-<service>-<hash>" still fits a DNS label. */}}
{{- define "k3.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* (list $ "decode") -> "<fullname>-decode" */}}
{{- define "k3.componentName" -}}
{{- printf "%s-%s" (include "k3.fullname" (index . 0)) (index . 1) -}}
{{- end -}}

{{/* Labels on every object: (list $ component). */}}
{{- define "k3.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: k3
k3.io/cluster: {{ $root.Values.cluster.name | quote }}
k3.io/region: {{ $root.Values.cluster.region | quote }}
k3.io/role: {{ $root.Values.cluster.role | quote }}
{{ include "k3.selectorLabels" . }}
{{- end -}}

{{/* Immutable selector labels: (list $ component). */}}
{{- define "k3.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A service's effective settings: serviceDefaults deep-merged with services.<name>, as JSON. */}}
{{- define "k3.spec" -}}
{{- $root := index . 0 -}}
{{- $own := index $root.Values.services (index . 1) | default dict -}}
{{- mergeOverwrite (deepCopy $root.Values.serviceDefaults) (deepCopy $own) | toJson -}}
{{- end -}}

{{/* Env var prefix for a service: kvtransfer -> K3_KVTRANSFER_ */}}
{{- define "k3.envPrefix" -}}
{{- printf "K3_%s_" (upper .) -}}
{{- end -}}

{{- define "k3.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "k3.fullname" .)) -}}
{{- end -}}

{{- define "k3.etcdHeadless" -}}
{{- printf "%s-etcd-headless" (include "k3.fullname" .) -}}
{{- end -}}

{{/* Comma-separated etcd host:port list (K3_ETCD_ENDPOINTS). */}}
{{- define "k3.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- printf "%s-etcd.%s.svc:2379" (include "k3.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* image reference for (list $ spec) */}}
{{- define "k3.image" -}}
{{- $root := index . 0 -}}
{{- $img := index $root.Values.image (index . 1).image -}}
{{- $ref := printf "%s/%s:%s" $root.Values.image.registry $img.repository ($root.Values.image.tag | default $root.Chart.AppVersion) -}}
{{- if $img.digest -}}{{- $ref = printf "%s@%s" $ref $img.digest -}}{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* Pod selector for the k3 pods of one component in this namespace, any release (control plane included). */}}
{{- define "k3.peerComponent" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/part-of: k3
      app.kubernetes.io/component: {{ . }}
{{- end -}}

{{/* Fail early, with the value's path, on combinations the schema cannot express: (list $ name spec). */}}
{{- define "k3.validateService" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $s := index . 2 -}}
{{- if and $s.gpu (gt (int $s.tensorParallel) (int $root.Values.gpu.perNode)) -}}
{{- fail (printf "services.%s.tensorParallel (%d) exceeds gpu.perNode (%d): one pod holds one TP group on one node" $name (int $s.tensorParallel) (int $root.Values.gpu.perNode)) -}}
{{- end -}}
{{- if and $s.gpu (ne $s.image "gpuWorker") -}}
{{- fail (printf "services.%s.gpu is true but services.%s.image is %q: GPU pods need the gpuWorker image" $name $name $s.image) -}}
{{- end -}}
{{- $a := $s.autoscaling -}}
{{- if $a.enabled -}}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) -}}
{{- fail (printf "services.%s.autoscaling.minReplicas (%d) is above maxReplicas (%d)" $name (int $a.minReplicas) (int $a.maxReplicas)) -}}
{{- end -}}
{{- if and (not $a.metrics) (eq (int $a.cpuUtilization) 0) -}}
{{- fail (printf "services.%s.autoscaling is enabled with no metrics and cpuUtilization 0: give it something to scale on" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
