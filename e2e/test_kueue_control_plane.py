"""Kueue in the local control plane: its CRDs come with every control plane, it starts on
request with its webhooks called on 127.0.0.1, and it stops without leaving them behind."""

from __future__ import annotations

from kubernetes import client
from kubernetes.client.rest import ApiException

from e2e.controlplane import ControlPlane
from e2e.fixtures import KubeAPI

GROUP, VERSION = "kueue.x-k8s.io", "v1beta2"


def _webhooks(kube_api: KubeAPI) -> list:
    api = client.AdmissionregistrationV1Api(kube_api.api_client)
    found = []
    for listed in (api.list_mutating_webhook_configuration(),
                   api.list_validating_webhook_configuration()):
        found += [hook for config in listed.items if config.metadata.name.startswith("kueue-")
                  for hook in config.webhooks]
    return found


def test_kueue_starts_and_stops_cleanly(control_plane: ControlPlane, kube_api: KubeAPI) -> None:
    assert f"workloads.{GROUP}" in control_plane.crd_names
    control_plane.start_kueue()
    process = control_plane.processes["kueue"]
    try:
        hooks = _webhooks(kube_api)
        port = control_plane.ports["kueue-webhook"]
        assert hooks and all(h.client_config.url.startswith(f"https://127.0.0.1:{port}/")
                             and h.client_config.service is None for h in hooks)
        # Only Kueue's own API and RayJobs: Pods, Jobs, Deployments... never wait for Kueue.
        groups = {g for h in hooks for rule in h.rules for g in rule.api_groups}
        assert groups == {GROUP, "ray.io"}
        assert {r for h in hooks for rule in h.rules if "ray.io" in rule.api_groups
                for r in rule.resources} == {"rayjobs"}
        # Served through the API server: the ResourceFlavor defaulting webhook adds its finalizer.
        flavor = kube_api.custom.create_cluster_custom_object(
            GROUP, VERSION, "resourceflavors",
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor",
             "metadata": {"name": "probe"}}, dry_run="All")
        assert "kueue.x-k8s.io/resource-in-use" in flavor["metadata"]["finalizers"]
        # The validating webhook answers too (the CRD's schema leaves label keys to it).
        try:
            kube_api.custom.create_cluster_custom_object(
                GROUP, VERSION, "resourceflavors",
                {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ResourceFlavor",
                 "metadata": {"name": "bad"}, "spec": {"nodeLabels": {"bad key!": "x"}}},
                dry_run="All")
        except ApiException as e:
            assert "vresourceflavor.kb.io" in e.body, e.body
        else:
            raise AssertionError("an invalid ResourceFlavor was accepted")
    finally:
        control_plane.stop_kueue()
    assert not process.alive()
    assert "kueue" not in control_plane.processes
    assert _webhooks(kube_api) == []
