"""Local Kubernetes control plane (built from upstream Go modules) and end-to-end tests."""
