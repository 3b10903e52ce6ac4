{{/*
Least privilege for the operator (kopf --standalone: no peering objects). Every rule says what needs it.
scope=cluster: one ClusterRole with everything, bound cluster-wide.
scope=namespace: a Role with the namespaced rules in each watched namespace, plus a ClusterRole with only the
CRD rule (kopf scans CustomResourceDefinitions, which are cluster-scoped).
*/}}
{{- define "tokenmill.namespacedRules" -}}
# kopf: list/watch the resources, patch finalizers and its progress annotations; the operator never writes spec.
- apiGroups: [tokenmill.io]
  resources: [datasetgenerations]
  verbs: [get, list, watch, patch]
# Status (observedGeneration, conditions, progress, report) through the status subresource.
- apiGroups: [tokenmill.io]
  resources: [datasetgenerations/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion on the children (OwnerReferencesPermissionEnforcement).
- apiGroups: [tokenmill.io]
  resources: [datasetgenerations/finalizers]
  verbs: [update]
# kopf: Events on the resources (stalls, failures, success).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
# Children: the SGLang server (server-side apply; deleted to give the GPUs back) and its pods' readiness.
- apiGroups: [apps]
  resources: [statefulsets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Children: the runner Indexed Job (created once, suspended/resumed by patch, replaced on a spec change).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# Children: headless Service of the server, runner ConfigMap (server-side apply).
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, create, patch]
# Children: NetworkPolicy that lets only the runner call the server.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
# The generated server API key Secret (create if absent) and the S3 credentials Secret named in the spec
# (read by name). No list/watch: the operator cannot enumerate Secrets. With scope cluster, `get` reaches any
# Secret of any namespace whose name it knows (docs/security.md); operator.policy.allowedSecrets narrows it to
# those names (the operator reads no other Secret: it only creates the API-key ones).
{{- with .Values.operator.policy.allowedSecrets }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
  resourceNames:
    {{- toYaml . | nindent 4 }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
{{- else }}
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
{{- end }}
# The shared model cache (spec.model.cache, docs/cluster.md): one claim per model digest, created if absent, and
# its fill Job (batch jobs above); patched to add each resource that serves the model to its owners.
- apiGroups: [""]
  resources: [persistentvolumeclaims]
  verbs: [get, create, patch]
# Kueue (docs/cluster.md): the Workload of a run labelled kueue.x-k8s.io/queue-name; listed for the run's place in
# its LocalQueue, deleted when the run ends, its quota handed back (status) after an eviction.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, create, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end }}
{{- define "tokenmill.crdRules" -}}
# kopf: scan CustomResourceDefinitions at startup and while running.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end }}
{{- define "tokenmill.nodeRules" -}}
# Planning: the GPU nodes' NVIDIA driver branch (GPU feature discovery's label nvidia.com/cuda.driver.major), so the
# image's CUDA is one the driver runs. Read-only, labels only; nodes are cluster-scoped.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
{{- end }}
