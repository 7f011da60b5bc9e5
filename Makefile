# The two commands a newcomer needs are `make demo` and `make test`; both set everything up first.
SHELL := bash
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test crd generate
setup:  ## create/refresh the pinned virtualenv (fast when already done)
	bash requirements/install.sh >&2

demo: setup  ## train the tiny GRPO example on CPU: build a tiny model offline, then rlhf run
	$(VENV)/bin/rlhf tiny-model manifests/examples/tiny/model
	rm -rf /tmp/rlhf/tiny-grpo-cpu runs/tiny-grpo-cpu  # checkpoint.path and outputs: a rerun would resume from the end
	$(VENV)/bin/rlhf run manifests/examples/tiny-grpo-cpu-job.yaml

test:  ## run the whole suite (tests/run.sh: installs, builds the control plane beside the first tests, pytest -n 4)
	tests/run.sh

crd: setup  ## regenerate crds/ from the API models
	$(VENV)/bin/rlhf crd > crds/rlhf.dev_rlhfjobs.yaml
	$(VENV)/bin/rlhf crd --kind RLHFRuntime > crds/rlhf.dev_rlhfruntimes.yaml
	$(VENV)/bin/rlhf crd --kind ClusterRLHFRuntime > crds/rlhf.dev_clusterrlhfruntimes.yaml

# Every generated file: the CRD (the chart's files/ links to it), the algorithm-defaults policy, and
# manifests/install.yaml (render-manifests.sh builds the pinned helm first when it is not cached).
generate: crd  ## regenerate every generated file from the API models and the algorithm catalogue
	$(VENV)/bin/rlhf defaults-policy > helm/rlhf-operator/files/algorithm-defaults-policy.yaml
	$(MAKE) manifests

.PHONY: images
images: setup  ## build the operator and CPU trainer images from their Dockerfiles with buildah (installs it with apt when missing; cached)
	$(PY) -m e2e.images

.PHONY: control-plane dev-cluster-up dev-cluster-kwok-up dev-cluster-down
control-plane:  ## build etcd, kube-apiserver/-controller-manager/-scheduler, kwok, KubeRay and helm (cached)
	e2e/build/build.sh

dev-cluster-up: setup  ## a local cluster that trains: control plane, KubeRay, a node running pods from the built images, the chart's operator; prints the KUBECONFIG export (needs root)
	@$(PY) -m e2e.pods.devcluster

dev-cluster-kwok-up: setup  ## a local control plane with kwok's fake GPU nodes and KubeRay (no pod runs); prints the KUBECONFIG export
	@$(PY) -m e2e.controlplane up

dev-cluster-down:  ## stop it
	$(PY) -m e2e.controlplane down

.PHONY: docs docs-build
docs: setup  ## serve the documentation site at http://127.0.0.1:8000 (mkdocs serve; reloads on edits)
	$(VENV)/bin/mkdocs serve

docs-build: setup  ## build the documentation site into site/, failing on a broken link or missing page
	$(VENV)/bin/mkdocs build --strict

.PHONY: manifests
manifests:  ## render the Helm chart into manifests/install.yaml
	helm/render-manifests.sh > manifests/install.yaml

# A release (helm/release.sh says what it makes): the images pushed to REGISTRY, the chart as an OCI chart
# there, and into DIST the chart's package, its rendered install.yaml and the CLI's wheel and sdist.
# VERSION must equal pyproject.toml's (the one place it is written). The cuda trainer image is about 10 GB
# to build: DEVICES=cpu leaves it out (the suite's release does). PLAIN_HTTP=1 for a registry on loopback.
DEVICES ?= cpu cuda
DIST ?= dist
.PHONY: release
release:  ## build and push a release: make release VERSION=x.y.z REGISTRY=host[:port]/org [DEVICES=cpu] [PLAIN_HTTP=1] (the cuda trainer image is ~10 GB; DEVICES=cpu skips it)
	VERSION="$(VERSION)" REGISTRY="$(REGISTRY)" DEVICES="$(DEVICES)" PLAIN_HTTP="$(PLAIN_HTTP)" DIST="$(DIST)" helm/release.sh
