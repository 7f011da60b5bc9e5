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

CACHE := $(or $(RLHF_CACHE),$(HOME)/.cache/rlhf-operator)
test:  ## run the whole suite; the local control plane builds in the background while Python installs
	@mkdir -p $(CACHE) && echo "control plane build (if needed) in the background: $(CACHE)/build.log" >&2
	@e2e/build/build.sh all > $(CACHE)/build.log 2>&1 & \
	  bash requirements/install.sh >&2 && $(PY) -m pytest; status=$$?; wait; exit $$status

crd: setup  ## regenerate crds/ from the API models
	$(VENV)/bin/rlhf crd > crds/rlhf.dev_rlhfjobs.yaml

# Every generated file: the CRD (the chart's files/ links to it), the algorithm-defaults policy, and
# manifests/install.yaml (render-manifests.sh builds the pinned helm first when it is not cached).
generate: crd  ## regenerate every generated file from the API models and the algorithm catalogue
	$(VENV)/bin/rlhf defaults-policy > helm/rlhf-operator/files/algorithm-defaults-policy.yaml
	$(MAKE) manifests

.PHONY: control-plane dev-cluster-up dev-cluster-down
control-plane:  ## build etcd, kube-apiserver/-controller-manager/-scheduler, kwok, KubeRay and helm (cached)
	e2e/build/build.sh

dev-cluster-up: setup  ## start a local control plane with kwok GPU nodes and KubeRay, and print the KUBECONFIG export
	@$(PY) -m e2e.controlplane up

dev-cluster-down:  ## stop it
	$(PY) -m e2e.controlplane down

.PHONY: manifests
manifests:  ## render the Helm chart into manifests/install.yaml
	helm/render-manifests.sh > manifests/install.yaml
