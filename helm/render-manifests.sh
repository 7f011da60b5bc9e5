#!/usr/bin/env bash
# Render the chart into the plain install manifests (manifests/install.yaml is this script's output), or the
# chart given, a packaged release's (helm/release.sh: its install.yaml).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/e2e/build/build.sh" helm >/dev/null
helm=$("$root/e2e/build/build.sh" paths | sed -n 's/^HELM=//p')
chart=${1:-$root/helm/rlhf-operator}
echo "# Rendered from ${chart#"$root/"} by helm/render-manifests.sh (make manifests). Do not edit."
# The manifests are for a cluster that serves MutatingAdmissionPolicy (Kubernetes 1.36 or later).
"$helm" template rlhf-operator "$chart" --namespace rlhf-system \
  --api-versions admissionregistration.k8s.io/v1/MutatingAdmissionPolicy --set createNamespace=true 2>/dev/null
