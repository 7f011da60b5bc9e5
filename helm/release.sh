#!/usr/bin/env bash
# A release: `make release VERSION=x.y.z REGISTRY=host[:port]/org` (the Makefile passes its variables here).
# Beside render-manifests.sh because it is chart and packaging tooling, not code of either half, and the
# top level is fixed. It makes, in this order, so that nothing is pushed before everything is built and the
# chart, which users install, goes last:
#   the images, built from the Dockerfiles (e2e/images: buildah without a Docker daemon, cached by content):
#     REGISTRY/operator:VERSION and REGISTRY/trainer:VERSION-DEVICE for each of DEVICES (default "cpu cuda";
#     the cuda trainer image is about 10 GB to build, DEVICES=cpu leaves it out);
#   into DIST (default dist/): the chart packaged as VERSION with its values naming those images
#     (rlhf-operator-VERSION.tgz), the same rendered for `kubectl apply` (install.yaml), the CLI's wheel and sdist;
#   then the images pushed, and the chart pushed as oci://REGISTRY/charts/rlhf-operator:VERSION.
# VERSION must be pyproject.toml's: the one place it is written, which the images' packages, the operator's
# default trainer images and the chart all derive. PLAIN_HTTP=1 speaks HTTP to the registry (one on this
# machine's loopback). Credentials are the tools' own: buildah's and helm's logins, or Docker's config.json.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
: "${VERSION:?set VERSION=x.y.z, the version in pyproject.toml}" "${REGISTRY:?set REGISTRY=host[:port]/org}"
DEVICES=${DEVICES:-cpu cuda}
DIST=${DIST:-$root/dist}
project=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$root/pyproject.toml")
if [[ $VERSION != "$project" ]]; then
  echo "VERSION=$VERSION, but pyproject.toml's version is $project: set it there first (everything derives it)" >&2
  exit 1
fi
tls=() plain_http=()
# A plain-HTTP registry is one on loopback: its layers go uncompressed (gzip of the 8 GB trainer took 3 of the
# suite's minutes and saves nothing on the same disk).
if [[ ${PLAIN_HTTP:-} == 1 ]]; then tls=(--tls-verify=false --disable-compression) plain_http=(--plain-http); fi
uv=$(command -v uv || echo "$root/.venv/bin/uv")
[[ -x $uv ]] || { echo "uv builds the CLI's wheel and sdist: make setup, or pip install uv" >&2; exit 1; }
"$root/e2e/build/build.sh" helm >&2
helm=$("$root/e2e/build/build.sh" paths | sed -n 's/^HELM=//p')
mkdir -p "$DIST"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$root"

# Each release name and the local image e2e/images built for it, a pair a line.
python3 - "$work/images" "$REGISTRY" "$VERSION" $DEVICES <<'PY'
import sys
from pathlib import Path

from e2e import images

pairs, registry, version, *devices = sys.argv[1:]
release = {f"{registry}/operator:{version}": images.OPERATOR}
release |= {f"{registry}/trainer:{version}-{device}": images.BY_NAME[f"trainer-{device}"] for device in devices}
Path(pairs).write_text("".join(f"{name} {images.build(image)}\n" for name, image in release.items()))
PY

# The chart: a copy whose values name the released images (-L: its files/ links to the CRD in crds/).
cp -RL "$root/helm/rlhf-operator" "$work/"
sed -i "s#^\(  repository: \)ghcr.io/rlhf-operator/#\1$REGISTRY/#" "$work/rlhf-operator/values.yaml"
for image in operator trainer; do
  grep -qx "  repository: $REGISTRY/$image" "$work/rlhf-operator/values.yaml" \
    || { echo "values.yaml: no repository line of $image to point at $REGISTRY" >&2; exit 1; }
done
"$helm" package "$work/rlhf-operator" --version "$VERSION" --app-version "$VERSION" -d "$DIST" >&2
chart=$DIST/rlhf-operator-$VERSION.tgz
"$root/helm/render-manifests.sh" "$chart" > "$DIST/install.yaml"
"$uv" build --out-dir "$DIST" >&2

# buildah on e2e/images' storage, where the builds left the images, under its lock: a build meanwhile (another
# checkout's, a test's) replaces the name and prunes the image being pushed ("image not known" halfway).
python3 - "$work/images" "${tls[@]}" <<'PY'
import sys

from e2e import images

pairs, *flags = sys.argv[1:]
with images.locked():
    for name, local in (line.split() for line in open(pairs)):
        images.run("buildah", "push", *flags, local, f"docker://{name}")
        print(f"pushed {name}", file=sys.stderr)
PY
"$helm" push "$chart" "oci://$REGISTRY/charts" "${plain_http[@]}" >&2
echo "released $VERSION: helm install rlhf-operator oci://$REGISTRY/charts/rlhf-operator --version $VERSION" >&2
