// Runs an Argo CD health script in gopher-lua as Argo CD does (see main.go); built on demand
// by tests/test_argocd_health.py into ${RLHF_CACHE:-$HOME/.cache/rlhf-operator}/bin/argocd-lua-<gopher-lua version>/.
module rlhf-operator/e2e/build/argocd-lua

go 1.26.0

require (
	github.com/yuin/gopher-lua v1.1.1
	layeh.com/gopher-json v0.0.0-20190114024228-97fed8db8427
)
