#!/usr/bin/env bash
# Build, once and cached by version, the binaries of the local Kubernetes control
# plane used by the e2e tests (see hack/cluster/README.md):
#
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  (k8s.io/kubernetes)
#   etcd                                                               (go.etcd.io/etcd/server/v3)
#   kwok, kwokctl                                                      (sigs.k8s.io/kwok)
#   helm                                                               (helm.sh/helm/v3)
#   promtool                                                           (github.com/prometheus/prometheus)
#   kueue (the controller manager) and its CRDs                        (sigs.k8s.io/kueue)
#
# Everything is built from Go modules through the Go module proxy; nothing is
# downloaded from release pages. Versions live in hack/cluster/versions.env.
#
# Layout (TOKENMILL_CACHE defaults to ~/.cache/tokenmill):
#   $TOKENMILL_CACHE/bin/<component>-v<version>/<binaries>   the results
#   $TOKENMILL_CACHE/src/<component>-v<version>/             consumer Go modules
#   $TOKENMILL_CACHE/go/{mod,build}                          GOMODCACHE / GOCACHE
#   $TOKENMILL_CACHE/logs/                                   build logs, timings
#
# Idempotent: a component whose versioned binaries exist and report the expected
# version is skipped, so a second run does nothing. A component is built into a
# temporary folder and moved into place only when all its binaries check out.
#
# Usage:
#   hack/build-tools.sh              build what is missing
#   hack/build-tools.sh --check      exit 1 (and say what is missing) unless all tools are present
#   hack/build-tools.sh --print-env  print KEY=VALUE lines with the tool paths (builds nothing)
#   hack/build-tools.sh --force C    rebuild component C (kubernetes|etcd|kwok|helm|promtool|kueue)
#   hack/build-tools.sh --only C     build component C if it is missing, nothing else
#   hack/build-tools.sh --prune-go-cache  delete the Go module/build caches (keeps the binaries)
# shellcheck disable=SC2317  # functions are called indirectly: trap, "check_${c}", "build_${c}"
set -Eeuo pipefail

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=cluster/versions.env
# shellcheck disable=SC1091
source "${HACK_DIR}/cluster/versions.env"

CACHE="${TOKENMILL_CACHE:-${HOME}/.cache/tokenmill}"
BIN_ROOT="${CACHE}/bin"
SRC_ROOT="${CACHE}/src"
LOG_DIR="${CACHE}/logs"

KUBE_DIR="${BIN_ROOT}/kubernetes-v${KUBE_VERSION}"
ETCD_DIR="${BIN_ROOT}/etcd-v${ETCD_VERSION}"
KWOK_DIR="${BIN_ROOT}/kwok-v${KWOK_VERSION}"
HELM_DIR="${BIN_ROOT}/helm-v${HELM_VERSION}"
PROMTOOL_DIR="${BIN_ROOT}/promtool-v${PROMETHEUS_VERSION}"
KUEUE_DIR="${BIN_ROOT}/kueue-v${KUEUE_VERSION}"

COMPONENTS=(kubernetes etcd kwok helm promtool kueue)

# Go's default install location, for shells (make, CI) whose PATH lacks it.
if ! command -v go >/dev/null 2>&1 && [[ -x /usr/local/go/bin/go ]]; then
  export PATH="/usr/local/go/bin:${PATH}"
fi

print_env() {
  cat <<EOF
TOKENMILL_CACHE=${CACHE}
KUBE_VERSION=${KUBE_VERSION}
KUBE_BIN_DIR=${KUBE_DIR}
KUBE_APISERVER_BIN=${KUBE_DIR}/kube-apiserver
KUBE_CONTROLLER_MANAGER_BIN=${KUBE_DIR}/kube-controller-manager
KUBE_SCHEDULER_BIN=${KUBE_DIR}/kube-scheduler
KUBECTL_BIN=${KUBE_DIR}/kubectl
ETCD_VERSION=${ETCD_VERSION}
ETCD_BIN=${ETCD_DIR}/etcd
KWOK_VERSION=${KWOK_VERSION}
KWOK_BIN=${KWOK_DIR}/kwok
KWOKCTL_BIN=${KWOK_DIR}/kwokctl
HELM_VERSION=${HELM_VERSION}
HELM_BIN=${HELM_DIR}/helm
PROMETHEUS_VERSION=${PROMETHEUS_VERSION}
PROMTOOL_BIN=${PROMTOOL_DIR}/promtool
KUEUE_VERSION=${KUEUE_VERSION}
KUEUE_BIN=${KUEUE_DIR}/kueue
KUEUE_CRD_DIR=${KUEUE_DIR}/crds
EOF
}

STEP="start"
CUR_LOG=""
on_error() {
  local rc=$?
  echo "build-tools: FAILED at step: ${STEP} (exit ${rc})" >&2
  if [[ -n "${CUR_LOG}" && -f "${CUR_LOG}" ]]; then
    echo "build-tools: last lines of ${CUR_LOG}:" >&2
    tail -n 40 "${CUR_LOG}" >&2 || true
  fi
  exit "${rc}"
}
trap on_error ERR

log() { echo "build-tools: $*" >&2; }
step() {  # step <description>: set STEP and leave a timestamped mark in the component's log
  STEP="$1"
  echo "[$(date -u +%T)] ${STEP}"
}

# ---------------------------------------------------------------------------
# version checks: "does this folder hold the right, runnable binaries?"

version_ok() {  # version_ok <binary> <expected substring> <args...>
  local bin="$1" want="$2"
  shift 2
  [[ -x "${bin}" ]] || return 1
  local out
  out="$("${bin}" "$@" 2>&1)" || return 1
  [[ "${out}" == *"${want}"* ]]
}

check_kubernetes() {  # check_kubernetes [dir]
  local d="${1:-${KUBE_DIR}}"
  version_ok "${d}/kube-apiserver" "Kubernetes v${KUBE_VERSION}" --version &&
    version_ok "${d}/kube-controller-manager" "Kubernetes v${KUBE_VERSION}" --version &&
    version_ok "${d}/kube-scheduler" "Kubernetes v${KUBE_VERSION}" --version &&
    version_ok "${d}/kubectl" "v${KUBE_VERSION}" version --client
}
check_etcd() { version_ok "${1:-${ETCD_DIR}}/etcd" "etcd Version: ${ETCD_VERSION}" --version; }
check_kwok() {
  local d="${1:-${KWOK_DIR}}"
  version_ok "${d}/kwok" "${KWOK_VERSION}" --version && version_ok "${d}/kwokctl" "${KWOK_VERSION}" --version
}
check_helm() { version_ok "${1:-${HELM_DIR}}/helm" "v${HELM_VERSION}" version --short; }
check_promtool() { version_ok "${1:-${PROMTOOL_DIR}}/promtool" "version ${PROMETHEUS_VERSION}" --version; }
check_kueue() {
  # The manager has no --version flag (it logs its version once connected); the build info names the module.
  local d="${1:-${KUEUE_DIR}}"
  [[ -x "${d}/kueue" && -f "${d}/crds/kueue.x-k8s.io_workloads.yaml" ]] || return 1
  command -v go >/dev/null 2>&1 || return 1
  [[ "$(go version -m "${d}/kueue" 2>/dev/null)" == *$'\tsigs.k8s.io/kueue\tv'"${KUEUE_VERSION}"* ]]
}

dir_of() {
  case "$1" in
    kubernetes) echo "${KUBE_DIR}" ;;
    etcd) echo "${ETCD_DIR}" ;;
    kwok) echo "${KWOK_DIR}" ;;
    helm) echo "${HELM_DIR}" ;;
    promtool) echo "${PROMTOOL_DIR}" ;;
    kueue) echo "${KUEUE_DIR}" ;;
    *) echo "unknown component: $1" >&2; return 2 ;;
  esac
}

# ---------------------------------------------------------------------------
# builders: each writes its binaries into "$1" (a fresh temporary folder)

go_env() {
  export GOMODCACHE="${CACHE}/go/mod"
  export GOCACHE="${CACHE}/go/build"
  export GOTOOLCHAIN=local          # never fetch a Go toolchain; fail loudly instead
  export CGO_ENABLED=0
  export GOFLAGS="-trimpath -buildvcs=false"
  export GOPROXY="${GOPROXY:-https://proxy.golang.org,direct}"
}

build_kubernetes() {
  local out="$1" v="${KUBE_VERSION}" minor
  minor="${v#1.}"
  minor="${minor%%.*}"
  local mod="${SRC_ROOT}/kubernetes-v${v}"
  mkdir -p "${mod}"
  cd "${mod}"
  step "kubernetes: go mod init (${mod})"
  [[ -f go.mod ]] || go mod init tokenmill.local/kubebins
  step "kubernetes: download k8s.io/kubernetes@v${v} go.mod"
  local kmod
  kmod="$(go mod download -json "k8s.io/kubernetes@v${v}" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
  [[ -f "${kmod}" ]] || { echo "no go.mod for k8s.io/kubernetes@v${v}" >&2; false; }
  step "kubernetes: replace the staging modules with their published v0.${minor} versions"
  local staging
  staging="$(sed -n 's|^[[:space:]]*\(k8s.io/[^ ]*\) => \./staging/src/.*|\1|p' "${kmod}")"
  [[ -n "${staging}" ]] || { echo "no staging replaces found in ${kmod}" >&2; false; }
  local m args=()
  for m in ${staging}; do args+=("-replace=${m}=${m}@v0.${v#1.}"); done
  go mod edit "${args[@]}"
  step "kubernetes: go get k8s.io/kubernetes@v${v} (module download)"
  go get -tool "k8s.io/kubernetes/cmd/kube-apiserver@v${v}" \
    "k8s.io/kubernetes/cmd/kube-controller-manager@v${v}" \
    "k8s.io/kubernetes/cmd/kube-scheduler@v${v}" \
    "k8s.io/kubernetes/cmd/kubectl@v${v}"
  local ld="-s -w" k
  for k in "gitVersion=v${v}" gitMajor=1 "gitMinor=${minor}" "gitCommit=v${v}" gitTreeState=clean \
    buildDate=1970-01-01T00:00:00Z; do
    ld+=" -X k8s.io/component-base/version.${k} -X k8s.io/client-go/pkg/version.${k}"
  done
  local c
  for c in kube-apiserver kube-controller-manager kube-scheduler kubectl; do
    step "kubernetes: go build ${c}"
    go build -ldflags "${ld}" -o "${out}/${c}" "k8s.io/kubernetes/cmd/${c}"
  done
}

build_etcd() {
  local out="$1" v="${ETCD_VERSION}"
  local mod="${SRC_ROOT}/etcd-v${v}"
  mkdir -p "${mod}"
  cd "${mod}"
  step "etcd: go mod init (${mod})"
  [[ -f go.mod ]] || go mod init tokenmill.local/etcdbin
  # go install ...@v fails: server/go.mod has replace directives (../api, ...).
  # In a consumer module those replaces are ignored and its requires are used.
  step "etcd: go get go.etcd.io/etcd/server/v3@v${v}"
  go get -tool "go.etcd.io/etcd/server/v3@v${v}"
  step "etcd: go build"
  go build -ldflags "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=v${v}" -o "${out}/etcd" go.etcd.io/etcd/server/v3
}

build_kwok() {
  local out="$1" v="${KWOK_VERSION}"
  step "kwok: go install sigs.k8s.io/kwok/cmd/{kwok,kwokctl}@v${v}"
  local ld="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${KUBE_VERSION}"
  GOBIN="${out}" go install -ldflags "${ld}" "sigs.k8s.io/kwok/cmd/kwok@v${v}" "sigs.k8s.io/kwok/cmd/kwokctl@v${v}"
}

build_helm() {
  local out="$1" v="${HELM_VERSION}"
  step "helm: read helm.sh/helm/v3@v${v} go.mod"
  local hmod cg minor
  hmod="$(go mod download -json "helm.sh/helm/v3@v${v}" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')"
  # helm's Makefile stamps the client-go minor as the default Kubernetes version
  # for `helm template` / `helm lint` (otherwise they assume v1.20).
  cg="$(sed -n 's|^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*|\1|p' "${hmod}" | head -n1)"
  [[ -n "${cg}" ]] || { echo "cannot find k8s.io/client-go in ${hmod}" >&2; false; }
  step "helm: go install helm.sh/helm/v3/cmd/helm@v${v}"
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=v${v} -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for minor in helm.sh/helm/v3/pkg/chartutil helm.sh/helm/v3/pkg/lint/rules; do
    ld+=" -X ${minor}.k8sVersionMajor=1 -X ${minor}.k8sVersionMinor=${cg}"
  done
  GOBIN="${out}" go install -ldflags "${ld}" "helm.sh/helm/v3/cmd/helm@v${v}"
}

build_promtool() {
  local out="$1" v="${PROMETHEUS_MODULE_VERSION}"
  step "promtool: go install github.com/prometheus/prometheus/cmd/promtool@v${v}"
  local p=github.com/prometheus/common/version
  local ld="-s -w -X ${p}.Version=${PROMETHEUS_VERSION} -X ${p}.Revision=v${v} -X ${p}.Branch=HEAD"
  ld+=" -X ${p}.BuildUser=tokenmill -X ${p}.BuildDate=19700101-00:00:00"
  GOBIN="${out}" go install -tags netgo -ldflags "${ld}" "github.com/prometheus/prometheus/cmd/promtool@v${v}"
}

build_kueue() {
  local out="$1" v="${KUEUE_VERSION}"
  step "kueue: go install sigs.k8s.io/kueue/cmd/kueue@v${v}"
  local p=sigs.k8s.io/kueue/pkg/version
  local ld="-s -w -X ${p}.GitVersion=v${v} -X ${p}.GitCommit=v${v} -X ${p}.BuildDate=1970-01-01T00:00:00Z"
  GOBIN="${out}" go install -ldflags "${ld}" "sigs.k8s.io/kueue/cmd/kueue@v${v}"
  # The CRDs ship in the module, not in the binary: keep them next to it (--prune-go-cache drops the module).
  step "kueue: copy the CRDs of sigs.k8s.io/kueue@v${v}"
  local dir
  dir="$(go mod download -json "sigs.k8s.io/kueue@v${v}" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')"
  mkdir -p "${out}/crds"
  cp "${dir}"/config/components/crd/bases/*.yaml "${out}/crds/"
  chmod -R u+w "${out}/crds"
}

# ---------------------------------------------------------------------------
# measurement helpers

mem_used_kib() { awk '/^MemTotal:/{t=$2} /^MemAvailable:/{a=$2} END{print t-a}' /proc/meminfo; }

MEM_SAMPLER_PID=""
start_mem_sampler() {  # records the peak of (MemTotal - MemAvailable) during the build
  local file="$1" base
  base="$(mem_used_kib)"
  echo "${base} ${base}" >"${file}"
  (
    local peak="${base}" now
    while sleep 1; do
      now="$(mem_used_kib)"
      if ((now > peak)); then
        peak="${now}"
        echo "${base} ${peak}" >"${file}"
      fi
    done
  ) &
  MEM_SAMPLER_PID=$!
}
stop_mem_sampler() {
  if [[ -n "${MEM_SAMPLER_PID}" ]]; then
    kill "${MEM_SAMPLER_PID}" 2>/dev/null || true
    wait "${MEM_SAMPLER_PID}" 2>/dev/null || true
    MEM_SAMPLER_PID=""
  fi
}

# build_component <name>: build into a temp folder, check, move into place, record numbers
build_component() {
  local c="$1" dest tmp t0 t1
  dest="$(dir_of "${c}")"
  tmp="${dest}.tmp.$$"
  rm -rf "${tmp}"
  mkdir -p "${tmp}" "${LOG_DIR}"
  CUR_LOG="${LOG_DIR}/${c}-$(basename "${dest}" | sed "s/^${c}-//").log"
  local memfile="${LOG_DIR}/${c}.mem"
  log "building ${c} -> ${dest} (log: ${CUR_LOG})"
  t0="$(date +%s)"
  start_mem_sampler "${memfile}"
  STEP="${c}: build"
  # Run the builder in a subshell so that its `cd` stays local; its output goes to the log.
  # GNU time (if present) records the peak RSS of the largest single process (compile/link).
  local timefile="${LOG_DIR}/${c}.time" rc=0
  local self
  self="${HACK_DIR}/$(basename "${BASH_SOURCE[0]}")"
  if [[ -x /usr/bin/time ]]; then
    /usr/bin/time -v -o "${timefile}" bash "${self}" --build-one "${c}" "${tmp}" >"${CUR_LOG}" 2>&1 || rc=$?
  else
    bash "${self}" --build-one "${c}" "${tmp}" >"${CUR_LOG}" 2>&1 || rc=$?
  fi
  stop_mem_sampler
  if ((rc != 0)); then
    rm -rf "${tmp}"
    STEP="$(sed -n 's/^build-tools: FAILED at step: \(.*\) (exit [0-9]*)$/\1/p' "${CUR_LOG}" | tail -n1)"
    STEP="${STEP:-${c}: build}"
    false
  fi
  STEP="${c}: check the built binaries"
  "check_${c}" "${tmp}" || {
    echo "built ${c} binaries in ${tmp} do not report the expected version" >&2
    false
  }
  rm -rf "${dest}"
  mv "${tmp}" "${dest}"
  t1="$(date +%s)"
  local rss="?" peak="?" base
  if [[ -f "${timefile}" ]]; then
    rss="$(awk -F': ' '/Maximum resident set size/{printf "%.0f", $2/1024}' "${timefile}")"
  fi
  read -r base peak <"${memfile}" || true
  local disk
  disk="$(du -sh "${dest}" | cut -f1)"
  local line
  line="$(printf '%s\t%s\twall=%ss\tmax_rss_single_proc=%sMiB\tsystem_mem_peak_delta=%sMiB\tdisk=%s' \
    "$(date -u +%FT%TZ)" "$(basename "${dest}")" "$((t1 - t0))" "${rss}" "$(((peak - base) / 1024))" "${disk}")"
  echo "${line}" >>"${LOG_DIR}/build-summary.tsv"
  log "built ${line}"
  CUR_LOG=""
}

# ---------------------------------------------------------------------------

main() {
  local mode="build" force="" only=""
  while (($#)); do
    case "$1" in
      --print-env) print_env; return 0 ;;
      --build-one)  # internal: build one component into a folder (output goes to its log)
        go_env
        "build_$2" "$3"
        return 0 ;;
      --check) mode="check" ;;
      --prune-go-cache)  # drop GOMODCACHE/GOCACHE/consumer modules (~9 GB); the binaries stay
        if [[ -d "${CACHE}/go/mod" ]]; then chmod -R u+w "${CACHE}/go/mod"; fi
        rm -rf "${CACHE}/go" "${SRC_ROOT}"
        log "removed ${CACHE}/go and ${SRC_ROOT}"
        return 0 ;;
      --force) force="$2"; shift ;;
      --only) only="$2"; shift ;;
      -h | --help) sed -n '2,31p' "${BASH_SOURCE[0]}"; return 0 ;;
      *) echo "unknown argument: $1" >&2; return 2 ;;
    esac
    shift
  done

  local c missing=()
  for c in "${COMPONENTS[@]}"; do
    if [[ -n "${only}" && "${c}" != "${only}" ]]; then continue; fi
    if [[ "${c}" == "${force}" ]] || ! "check_${c}"; then missing+=("${c}"); fi
  done
  if [[ "${mode}" == "check" ]]; then
    if ((${#missing[@]})); then
      echo "build-tools: missing or wrong version: ${missing[*]} (run: make tools)" >&2
      trap - ERR
      return 1
    fi
    return 0
  fi
  if ((${#missing[@]} == 0)); then
    log "all tools present in ${BIN_ROOT} (nothing to do)"
    return 0
  fi

  STEP="preflight"
  command -v go >/dev/null || { echo "go is not installed (need Go >= 1.26)" >&2; false; }
  local gov
  gov="$(go env GOVERSION)"
  case "${gov}" in
    go1.2[6-9]* | go1.[3-9]*) ;;
    *) echo "need Go >= 1.26, found ${gov}" >&2; false ;;
  esac
  mkdir -p "${BIN_ROOT}" "${SRC_ROOT}" "${LOG_DIR}"

  local t0
  t0="$(date +%s)"
  for c in "${missing[@]}"; do build_component "${c}"; done
  log "done in $(($(date +%s) - t0))s; GOMODCACHE $(du -sh "${CACHE}/go/mod" 2>/dev/null | cut -f1), GOCACHE $(du -sh "${CACHE}/go/build" 2>/dev/null | cut -f1)"
}

main "$@"
exit $?
