# Local Kubernetes control plane (included by the main Makefile: `include hack/cluster.mk`).
# See hack/cluster/README.md. The e2e tests themselves need no target here: the pytest session
# fixture (tests/e2e/conftest.py) starts and stops its own cluster, so `make test` only needs `tools`.

CLUSTER_SH := hack/cluster/cluster.sh

.PHONY: tools tools-check tools-prune cluster-up cluster-down cluster-status cluster-gc cluster-demo

## tools: build (once, cached by version under TOKENMILL_CACHE, default ~/.cache/tokenmill) kube-apiserver,
##        kube-controller-manager, kube-scheduler, kubectl, etcd, kwok, kwokctl, helm, promtool
tools:
	hack/build-tools.sh

## tools-check: fail unless every tool is built (builds nothing)
tools-check:
	hack/build-tools.sh --check

## tools-prune: delete the Go module/build caches of the tool builds (~9 GB); keeps the binaries
tools-prune:
	hack/build-tools.sh --prune-go-cache

## cluster-up: start (or reuse) the kwok cluster "tokenmill"; kubeconfig at .cluster/kubeconfig
cluster-up: tools
	$(CLUSTER_SH) up

## cluster-down: delete the "tokenmill" cluster (no-op if it is not there)
cluster-down:
	$(CLUSTER_SH) down

## cluster-status: exit 0 if the "tokenmill" cluster answers
cluster-status:
	$(CLUSTER_SH) status

## cluster-gc: delete e2e clusters left behind by killed pytest runs
cluster-gc:
	$(CLUSTER_SH) gc

## cluster-demo: examples/b5-openthoughts.yaml on the local cluster, Pending to Succeeded in `kubectl get dsgen -w`;
##               the operator, S3, SGLang (the simulator) and the runner pods run on this machine (docs/operator.md)
cluster-demo: install tools
	$(PYTHON) hack/cluster_demo.py
