"""The RLHFJob CRD on a real API server: admission (OpenAPI schema + CEL) and the status
subresource.

Conventions used (files owned by the API engineers):
- crds/rlhf.dev_rlhfjobs.yaml is the CRD (installed by the control_plane fixture);
- tests/specs/invalid/*.yaml each hold one invalid RLHFJob; a comment line
  ``# server: <substring>`` gives the API server's refusal message (``# expect:`` is the
  local validator's wording and is not used here); a file without ``# server:`` is only
  refused by the operator and is skipped here;
- manifests/examples/*.yaml are valid RLHFJobs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from kubernetes.client.rest import ApiException

from e2e.fixtures import KubeAPI, example_jobs

REPO = Path(__file__).resolve().parent.parent
CRD = REPO / "crds" / "rlhf.dev_rlhfjobs.yaml"
INVALID = sorted(p for p in (REPO / "tests" / "specs" / "invalid").glob("*.yaml")
                 if not p.name.startswith("."))
EXAMPLES = example_jobs()
GROUP, VERSION, PLURAL = "rlhf.dev", "v1alpha1", "rlhfjobs"

pytestmark = pytest.mark.skipif(not CRD.exists(), reason=f"{CRD.relative_to(REPO)} not there yet")


@pytest.fixture(scope="module")
def rlhfjob_crd(control_plane) -> str:
    """The RLHFJob CRD as installed by the control plane; fails with the API server's
    refusal when it did not accept the CRD."""
    error = control_plane.crd_errors.get(str(CRD))
    if error:
        pytest.fail(f"the API server refused {CRD.relative_to(REPO)}:\n{error}", pytrace=False)
    assert "rlhfjobs.rlhf.dev" in control_plane.crd_names
    return "rlhfjobs.rlhf.dev"


def _server_expectation(path: Path) -> str | None:
    for line in path.read_text().splitlines():
        if line.startswith("# server:"):
            return line.removeprefix("# server:").strip()
    return None


def _rlhfjobs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text())
            if isinstance(d, dict) and d.get("kind") == "RLHFJob"]


def _create(kube_api: KubeAPI, namespace: str, body: dict) -> dict:
    # Strict field validation, as kubectl does by default: unknown fields are errors.
    return kube_api.custom.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, body, field_validation="Strict")


def _contains(stored, sent, path="spec") -> list[str]:
    """Paths where `sent` is not found in `stored` (server defaults may add fields)."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [path]
        return [p for k, v in sent.items() for p in _contains(stored.get(k), v, f"{path}.{k}")]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [path]
        return [p for i, (a, b) in enumerate(zip(stored, sent)) for p in
                _contains(a, b, f"{path}[{i}]")]
    return [] if stored == sent else [f"{path} ({stored!r} != {sent!r})"]


@pytest.mark.parametrize("spec_file", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_rlhfjob_is_refused_by_the_api_server(kube_api: KubeAPI, rlhfjob_crd: str,
                                                      namespace: str, spec_file: Path) -> None:
    expected = _server_expectation(spec_file)
    if expected is None:
        pytest.skip("no '# server:' line: only the operator refuses this one")
    (body,) = _rlhfjobs(spec_file)
    with pytest.raises(ApiException) as refused:
        _create(kube_api, namespace, body)
    err = refused.value
    assert err.status in (400, 422), err
    message = json.loads(err.body).get("message", err.body)
    assert expected in message, f"expected {expected!r} in the API server's message:\n{message}"
    # Nothing was stored.
    stored = kube_api.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    assert stored["items"] == []


def test_the_api_server_accepts_the_rlhfjob_crd(rlhfjob_crd: str) -> None:
    assert rlhfjob_crd == "rlhfjobs.rlhf.dev"


def test_there_are_invalid_specs_to_check() -> None:
    assert INVALID, "tests/specs/invalid/*.yaml is empty"
    assert any(_server_expectation(p) for p in INVALID)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_valid_example_is_stored_as_sent(kube_api: KubeAPI, rlhfjob_crd: str, namespace: str,
                                         example: Path) -> None:
    for body in _rlhfjobs(example):
        created = _create(kube_api, namespace, body)
        stored = kube_api.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, created["metadata"]["name"])
        # Nothing the user wrote was pruned or rewritten.
        assert _contains(stored["spec"], body["spec"]) == []


def test_status_subresource_is_separate_from_spec(kube_api: KubeAPI, rlhfjob_crd: str,
                                                  namespace: str) -> None:
    assert EXAMPLES, "manifests/examples/*.yaml is empty"
    body = _rlhfjobs(EXAMPLES[0])[0]
    name = body["metadata"]["name"]
    custom = kube_api.custom
    created = _create(kube_api, namespace, body)
    generation = created["metadata"]["generation"]

    # Writing status on the main resource is ignored (status is a subresource).
    with_status = copy.deepcopy(created)
    with_status["status"] = {"phase": "Failed", "message": "written through the main resource"}
    after_main = custom.replace_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, with_status)
    assert "phase" not in (after_main.get("status") or {})

    # A status patch changes status only: spec and generation stay as they were.
    status = {"phase": "Running", "observedGeneration": generation,
              "progress": {"step": 3, "totalSteps": 10, "percent": 30.0},
              "metrics": {"rewardMean": 0.25, "kl": 0.01}}
    patched = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status})
    assert patched["status"]["phase"] == "Running"
    assert patched["status"]["progress"]["step"] == 3
    assert patched["spec"] == created["spec"]
    assert patched["metadata"]["generation"] == generation

    # A spec change through the main resource bumps generation and leaves status alone,
    # even when the patch also carries a status.
    flipped = not created["spec"].get("suspend", False)
    after_spec = custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name,
        {"spec": {"suspend": flipped}, "status": {"phase": "Failed"}})
    assert after_spec["spec"]["suspend"] is flipped
    assert after_spec["metadata"]["generation"] == generation + 1
    assert after_spec["status"] == patched["status"]

    # The status subresource validates too: a phase outside the enum is refused.
    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": {"phase": "Exploded"}})
    assert refused.value.status == 422
    assert "status.phase" in json.loads(refused.value.body)["message"]


@pytest.mark.parametrize("change", [{"queueName": "team-b"}, {"queueName": None}],
                         ids=["changed", "removed"])
def test_the_queue_is_chosen_once(kube_api: KubeAPI, rlhfjob_crd: str, namespace: str, change: dict) -> None:
    """Kueue's webhook refuses to relabel an admitted RayJob, and an operator that tried looped on the
    refusal; the API server refuses the edit instead, saying what to do."""
    body = copy.deepcopy(_rlhfjobs(EXAMPLES[0])[0])
    body["spec"]["queueName"] = "team-a"
    created = _create(kube_api, namespace, body)
    name = created["metadata"]["name"]
    with pytest.raises(ApiException) as refused:
        kube_api.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": change})
    assert refused.value.status == 422
    assert "delete the RLHFJob and create it again" in json.loads(refused.value.body)["message"]
    unqueued = copy.deepcopy(_rlhfjobs(EXAMPLES[0])[0])
    unqueued["metadata"]["name"] = f"{name}-unqueued"
    _create(kube_api, namespace, unqueued)
    with pytest.raises(ApiException):
        kube_api.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, f"{name}-unqueued",
                                                       {"spec": {"queueName": "team-a"}})
    # The lifecycle fields stay editable.
    kube_api.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                   {"spec": {"suspend": True, "activeDeadlineSeconds": 600}})


def test_conditions_are_a_map_keyed_by_type(rlhfjob_crd: str) -> None:
    """Server-side apply merges conditions by type (kstatus, Argo CD) only with these markers."""
    crd = yaml.safe_load(CRD.read_text())
    conditions = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
