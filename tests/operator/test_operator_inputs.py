"""Pipelines, the parts without a cluster: which waiting jobs an input's event moves (inputs.waiting_for),
the stages' order and cycles (rlhf_api.pipeline.in_order), and what a finished job exports (output_model).
The operator's behaviour on a real control plane: e2e/operator/test_pipeline.py."""

from __future__ import annotations

import pytest

from rlhf_api import pipeline
from rlhf_api import v1alpha1 as api
from rlhf_operator.inputs import waiting_for


def _waiting(name: str, seen: dict, phase: str = "Waiting", namespace: str = "team") -> tuple:
    return (namespace, name), [{"metadata": {"name": name}, "status": {"phase": phase, "inputs": [
        {"role": "actor", "name": "sft", **seen}]}}]


def test_an_input_s_event_moves_the_waiting_jobs_that_saw_it_otherwise():
    jobs = dict([
        _waiting("saw-nothing", {}),  # the input did not exist yet
        _waiting("saw-it-pending", {"uid": "u1", "phase": "Pending"}),
        _waiting("started", {"uid": "u1", "phase": "Succeeded"}, phase="Pending"),  # not waiting any more
        _waiting("elsewhere", {}, namespace="other"),
    ])
    moved = lambda uid, phase: sorted(job["metadata"]["name"] for job in waiting_for(jobs, "team", "sft", uid, phase))  # noqa: E731
    assert moved("u1", None) == ["saw-it-pending", "saw-nothing"]  # created, before its first status
    assert moved("u1", "Pending") == ["saw-nothing"]
    assert moved("u1", "Succeeded") == ["saw-it-pending", "saw-nothing"]
    assert moved(None, None) == ["saw-it-pending"]  # deleted


def _spec(**models) -> api.RLHFJobSpec:
    return api.RLHFJobSpec.model_validate({
        "algorithm": "sft", "models": {"actor": {"path": "org/model"}, **models},
        "data": {"sft": {"sources": [{"path": "org/data"}]}}, "checkpoint": {"pvc": "stages"}})


def test_stages_run_after_the_jobs_they_name_and_a_cycle_is_refused_by_name():
    from_sft = {"actor": {"fromJob": {"name": "sft"}}}
    specs = {"ppo": _spec(**from_sft, reward={"fromJob": {"name": "rm"}}), "rm": _spec(**from_sft), "sft": _spec()}
    order = pipeline.in_order(specs)
    assert order.index("sft") < order.index("rm") < order.index("ppo")
    with pytest.raises(pipeline.Cycle, match=r"\(a <- b <- a\)"):
        pipeline.in_order({"a": _spec(actor={"fromJob": {"name": "b"}}), "b": _spec(actor={"fromJob": {"name": "a"}})})


@pytest.mark.parametrize(("change", "exported"), [
    ({}, "final"),
    ({"models": {"actor": {"path": "org/model", "lora": {"exportMerged": True}}}}, "final/merged"),
    ({"models": {"actor": {"path": "org/model", "lora": {}}}}, "LoRA adapters without lora.exportMerged"),
    ({"checkpoint": {"exportHf": False, "pvc": "stages"}}, "exportHf: false"),
    ({"checkpoint": {}}, "no spec.checkpoint.pvc"),
])
def test_what_a_finished_job_exports_for_the_next(change, exported):
    spec = api.RLHFJobSpec.model_validate({**_spec().model_dump(by_alias=True, exclude_none=True), **change})
    output = pipeline.output_model("sft", spec, step=7, best=False)
    if output is None:
        assert exported in pipeline.unexported(spec)
    else:
        assert (output.claim_name, output.sub_path, output.final, output.kind, output.step) == (
            "stages", "sft", exported, "policy", 7)
        assert pipeline.problem("reward", api.JobModelRef(name="sft"), output.kind, has_best=False) is not None
        assert pipeline.problem("critic", api.JobModelRef(name="sft"), output.kind, has_best=False) is None
