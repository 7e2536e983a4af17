#!/usr/bin/env bash
# Go-built tools the tests use, built from their Go modules and cached in .cache/tools:
#   helm (helm.sh/helm/v3)                      `helm lint` / `helm template` of helm/switchyard
#   kube-apiserver (k8s.io/kubernetes) + etcd   a real API server for the control process
#   otelcol (collector core + contrib modules)  receives the proxy's OTLP traces
# kube-apiserver, etcd and the collector are pinned by the modules under scripts/go/ (go.mod and
# go.sum checked in). Prints nothing when the cache is warm. Needs Go (on the project machines).
set -euo pipefail
cd "$(dirname "$0")/.."

tools=.cache/tools
mkdir -p "$tools"
command -v go > /dev/null || { echo "Go is needed to build the test tools" >&2; exit 1; }

# build NAME-VERSION: run the rest of the arguments (a build writing $out) unless cached.
build() {
  local name=$1 versioned=$2
  shift 2
  if [ ! -x "$tools/$versioned" ]; then
    echo "== building $versioned from its Go modules (cached in $tools)"
    out="$PWD/$tools/$versioned.partial"
    "$@"
    mv "$out" "$tools/$versioned"
  fi
  ln -sf "$versioned" "$tools/$name"
}

helm_version=v3.17.3
install_helm() {
  GOBIN="$PWD/$tools/build" go install "helm.sh/helm/v3/cmd/helm@$helm_version"
  mv "$tools/build/helm" "$out"
}
build helm "helm-$helm_version" install_helm

# Versions come from the modules' go.mod; the names carry them so a bump rebuilds.
module_version() { sed -n "s|^\t$2 \(v[^ ]*\).*|\1|p" "scripts/go/$1/go.mod" | head -1; }
go_build() { go build -C "scripts/go/$1" -trimpath -buildvcs=false -ldflags=-s -o "$out" "$2"; }

build kube-apiserver "kube-apiserver-$(module_version kube-apiserver k8s.io/kubernetes)" \
  go_build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build etcd "etcd-$(module_version etcd go.etcd.io/etcd/server/v3)" \
  go_build etcd go.etcd.io/etcd/server/v3
build otelcol "otelcol-$(module_version otelcol go.opentelemetry.io/collector/otelcol)" \
  go_build otelcol .
