"""observe: every read of the cluster, a tenant's store and a tenant's pods (the API server, S3 or a folder, the
server pods' /metrics), handed on as plain facts.

Imports decide (the plain data it fills) and kube (the client); never act (pyproject.toml, "The operator reads
observe -> decide -> act")."""
