#!/usr/bin/env bash
# Go-built tools the tests use, built from their Go modules and cached in .cache/tools:
#   helm (helm.sh/helm/v3) for `helm lint` / `helm template` of helm/switchyard.
# Prints nothing when the cache is warm. Needs Go (installed on the project machines).
set -euo pipefail
cd "$(dirname "$0")/.."

helm_version=v3.17.3
tools=.cache/tools
mkdir -p "$tools"
if [ ! -x "$tools/helm-$helm_version" ]; then
  command -v go > /dev/null || { echo "Go is needed to build helm ($helm_version)" >&2; exit 1; }
  echo "== building helm $helm_version from its Go modules (cached in $tools)"
  GOBIN="$PWD/$tools/build" go install "helm.sh/helm/v3/cmd/helm@$helm_version"
  mv "$tools/build/helm" "$tools/helm-$helm_version"
fi
ln -sf "helm-$helm_version" "$tools/helm"
