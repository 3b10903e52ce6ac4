#!/usr/bin/env bash
# Local Kubernetes control plane for the tests: kwokctl with the binary runtime and only
# locally built binaries (hack/build-tools.sh), fake GPU/CPU nodes (nodes.yaml) and the
# kwok Stage set in stages.yaml. See hack/cluster/README.md.
#
# Usage:
#   hack/cluster/cluster.sh up      [--name N] [--kubeconfig PATH]   create (or reuse) a cluster
#   hack/cluster/cluster.sh down    [--name N] [--kubeconfig PATH]   delete it (no-op if absent)
#   hack/cluster/cluster.sh status  [--name N] [--kubeconfig PATH]   exit 0 if it answers /readyz
#   hack/cluster/cluster.sh gc                                        delete e2e clusters whose pytest is gone
#
# Environment:
#   TOKENMILL_CLUSTER_DIR   state folder (default: <repo>/.cluster, git-ignored); kwok's
#                           workdir is $TOKENMILL_CLUSTER_DIR/kwok
#   TOKENMILL_CLUSTER_NAME  cluster name (default: tokenmill)
#   TOKENMILL_CACHE         tool cache (see hack/build-tools.sh)
#   TOKENMILL_KEEP_LOGS     if set, `down` first copies the component logs (kube-apiserver, etcd,
#                           kube-controller-manager, kube-scheduler, kwok-controller) to
#                           $TOKENMILL_CLUSTER_DIR/logs/<name>/
#
# Every component port (kube-apiserver, etcd client/peer, controller-manager, scheduler,
# kwok-controller) is a fresh free port from the kernel, so clusters of two runs on one
# machine never share a port; names must differ too (the pytest fixture uses tm-e2e-<pid>-<rand>).
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${HERE}/../.." && pwd)"
STATE_DIR="${TOKENMILL_CLUSTER_DIR:-${REPO}/.cluster}"
export KWOK_WORKDIR="${STATE_DIR}/kwok"

STEP="start"
on_error() {
  local rc=$?
  echo "cluster: FAILED at step: ${STEP} (exit ${rc})" >&2
  exit "${rc}"
}
trap on_error ERR
log() { echo "cluster: $*" >&2; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

load_tools() {
  STEP="check tools"
  if ! "${REPO}/hack/build-tools.sh" --check; then
    echo "cluster: the control-plane tools are not built: run 'make tools' (hack/build-tools.sh)" >&2
    return 1
  fi
  # kwokctl looks kubectl up on PATH first: make it find the version-matched one.
  export PATH="${KUBE_BIN_DIR}:${PATH}"
}

kctl() {
  local k="${KUBECTL_BIN}"
  [[ -x "${k}" ]] || k=kubectl
  "${k}" --kubeconfig "${KUBECONFIG_OUT}" "$@"; }

free_ports() {  # prints N distinct free TCP ports on 127.0.0.1 (held open together while choosing)
  python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
sys.stdout.write(" ".join(str(s.getsockname()[1]) for s in socks) + "\n")
for s in socks:
    s.close()
EOF
}

cluster_dir() { echo "${KWOK_WORKDIR}/clusters/${NAME}"; }
# kwokctl create/delete add/remove a context in a kubeconfig (default ~/.kube/config; an empty
# path is refused by delete): give each cluster its own throwaway file instead.
contexts_file() { echo "${STATE_DIR}/${NAME}.kwokctl-contexts"; }

healthy() {
  [[ -f "${KUBECONFIG_OUT}" ]] && kctl get --raw /readyz --request-timeout=5s >/dev/null 2>&1
}

write_config() {  # write_config <file> <apiserver> <etcd> <etcd-peer> <kcm> <scheduler> <kwok>
  cat >"$1" <<EOF
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokctlConfiguration
options:
  runtime: binary
  kubeVersion: v${KUBE_VERSION}
  kubeApiserverBinary: ${KUBE_APISERVER_BIN}
  kubeControllerManagerBinary: ${KUBE_CONTROLLER_MANAGER_BIN}
  kubeSchedulerBinary: ${KUBE_SCHEDULER_BIN}
  kubectlBinary: ${KUBECTL_BIN}
  kwokControllerBinary: ${KWOK_BIN}
  etcdBinary: ${ETCD_BIN}
  kubeApiserverPort: $2
  etcdPort: $3
  etcdPeerPort: $4
  kubeControllerManagerPort: $5
  kubeSchedulerPort: $6
  kwokControllerPort: $7
EOF
  cat "${HERE}/stages.yaml" >>"$1"
}

cmd_up() {
  local t0
  t0="$(now)"
  load_tools
  mkdir -p "${STATE_DIR}" "$(dirname "${KUBECONFIG_OUT}")"
  if [[ -d "$(cluster_dir)" ]]; then
    if healthy; then
      log "cluster ${NAME} is already up (KUBECONFIG=${KUBECONFIG_OUT})"
      return 0
    fi
    log "cluster ${NAME} exists but does not answer: recreating it"
    STEP="delete stale cluster ${NAME}"
    "${KWOKCTL_BIN}" delete cluster --name "${NAME}" --kubeconfig "$(contexts_file)" >>"${STATE_DIR}/${NAME}.log" 2>&1 || true
  fi

  local attempt ports cfg="${STATE_DIR}/${NAME}.kwokctl.yaml" ok=""
  for attempt in 1 2 3; do
    STEP="choose free ports"
    read -r -a ports <<<"$(free_ports 6)"
    write_config "${cfg}" "${ports[@]}"
    STEP="kwokctl create cluster ${NAME} (attempt ${attempt}, log ${STATE_DIR}/${NAME}.log)"
    log "creating ${NAME} (kube-apiserver port ${ports[0]}, attempt ${attempt})"
    if "${KWOKCTL_BIN}" --config "${cfg}" create cluster --name "${NAME}" --runtime binary --wait 2m --kubeconfig "$(contexts_file)" \
      >>"${STATE_DIR}/${NAME}.log" 2>&1; then
      ok=1
      break
    fi
    log "kwokctl create cluster failed (attempt ${attempt}); last lines of ${STATE_DIR}/${NAME}.log:"
    tail -n 20 "${STATE_DIR}/${NAME}.log" >&2 || true
    "${KWOKCTL_BIN}" delete cluster --name "${NAME}" --kubeconfig "$(contexts_file)" >>"${STATE_DIR}/${NAME}.log" 2>&1 || true
  done
  STEP="kwokctl create cluster ${NAME} (3 attempts; see ${STATE_DIR}/${NAME}.log)"
  [[ -n "${ok}" ]]

  STEP="write kubeconfig ${KUBECONFIG_OUT}"
  "${KWOKCTL_BIN}" get kubeconfig --name "${NAME}" >"${KUBECONFIG_OUT}.tmp"
  mv "${KUBECONFIG_OUT}.tmp" "${KUBECONFIG_OUT}"

  STEP="wait for kube-apiserver /readyz"
  for _ in $(seq 1 120); do
    healthy && break
    sleep 0.5
  done
  healthy

  STEP="create the fake nodes (hack/cluster/nodes.yaml)"
  kctl apply -f "${HERE}/nodes.yaml" >/dev/null
  STEP="wait for the nodes to be Ready"
  kctl wait --for=condition=Ready node --all --timeout=120s >/dev/null
  STEP="wait for the default ServiceAccount"
  for _ in $(seq 1 120); do
    kctl get serviceaccount default -n default >/dev/null 2>&1 && break
    sleep 0.5
  done
  kctl get serviceaccount default -n default >/dev/null
  log "cluster ${NAME} up in $(since "${t0}")s: KUBECONFIG=${KUBECONFIG_OUT}"
}

cmd_down() {
  local t0
  t0="$(now)"
  if [[ ! -d "$(cluster_dir)" ]]; then
    log "cluster ${NAME} is not there (nothing to delete)"
    rm -f "${KUBECONFIG_OUT}"
    return 0
  fi
  STEP="locate kwokctl"
  [[ -x "${KWOKCTL_BIN}" ]] || { echo "kwokctl not found at ${KWOKCTL_BIN}: run 'make tools'" >&2; false; }
  if [[ -n "${TOKENMILL_KEEP_LOGS:-}" ]]; then
    STEP="keep the component logs"
    mkdir -p "${STATE_DIR}/logs/${NAME}"
    cp -r "$(cluster_dir)/logs/." "${STATE_DIR}/logs/${NAME}/" 2>/dev/null || true
    cp "${STATE_DIR}/${NAME}.log" "${STATE_DIR}/logs/${NAME}/kwokctl.log" 2>/dev/null || true
    log "component logs of ${NAME} kept in ${STATE_DIR}/logs/${NAME}"
  fi
  STEP="kwokctl delete cluster ${NAME} (log ${STATE_DIR}/${NAME}.log)"
  "${KWOKCTL_BIN}" delete cluster --name "${NAME}" --kubeconfig "$(contexts_file)" >>"${STATE_DIR}/${NAME}.log" 2>&1
  rm -f "${KUBECONFIG_OUT}" "${STATE_DIR}/${NAME}.kwokctl.yaml" "$(contexts_file)" "${STATE_DIR}/${NAME}.log"
  log "cluster ${NAME} deleted in $(since "${t0}")s"
}

cmd_status() {
  if [[ -d "$(cluster_dir)" ]] && healthy; then
    log "cluster ${NAME} is up (KUBECONFIG=${KUBECONFIG_OUT})"
    return 0
  fi
  log "cluster ${NAME} is not up"
  trap - ERR
  return 1
}

cmd_gc() {  # delete tm-e2e-<pid>-<rand> clusters whose pytest process is gone
  local d n pid
  for d in "${KWOK_WORKDIR}"/clusters/tm-e2e-*; do
    [[ -d "${d}" ]] || continue
    n="$(basename "${d}")"
    pid="$(echo "${n}" | sed -n 's/^tm-e2e-\([0-9]*\)-.*/\1/p')"
    if [[ -n "${pid}" ]] && kill -0 "${pid}" 2>/dev/null; then continue; fi
    log "removing leftover cluster ${n}"
    NAME="${n}" KUBECONFIG_OUT="${STATE_DIR}/${n}.kubeconfig" cmd_down || true
  done
}

main() {
  local cmd="${1:-}"
  [[ -n "${cmd}" ]] || { sed -n '2,20p' "${BASH_SOURCE[0]}"; return 2; }
  shift
  # tool paths (KUBECTL_BIN, KWOKCTL_BIN, ...); load_tools checks that they are built
  eval "$("${REPO}/hack/build-tools.sh" --print-env)"
  NAME="${TOKENMILL_CLUSTER_NAME:-tokenmill}"
  KUBECONFIG_OUT=""
  while (($#)); do
    case "$1" in
      --name) NAME="$2"; shift ;;
      --kubeconfig) KUBECONFIG_OUT="$2"; shift ;;
      *) echo "unknown argument: $1" >&2; return 2 ;;
    esac
    shift
  done
  if [[ -z "${KUBECONFIG_OUT}" ]]; then
    if [[ "${NAME}" == tokenmill ]]; then
      KUBECONFIG_OUT="${STATE_DIR}/kubeconfig"
    else
      KUBECONFIG_OUT="${STATE_DIR}/${NAME}.kubeconfig"
    fi
  fi
  case "${cmd}" in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    gc) cmd_gc ;;
    *) echo "unknown command: ${cmd} (up|down|status|gc)" >&2; return 2 ;;
  esac
}

main "$@"
