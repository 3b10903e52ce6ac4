"""act: the operator's writes to the cluster (children, the status, Events, the measured-constants ConfigMap).

Imports decide (what to write) and kube (the client); never observe: a write acts on a decision, not on a read of
its own (pyproject.toml, "The operator reads observe -> decide -> act")."""
