"""reconcile validates a job's spec once per (uid, generation): a resync or a status event of an
unchanged job does not evaluate the CRD's CEL rules again; a new generation is validated afresh."""

from __future__ import annotations

import copy

import pytest
from rlhf_api.validation import InvalidJob

from rlhf_operator import reconcile
from tests.operator.operator_jobs import NAMESPACE, UID, load_example


def body(generation: int, **spec: object) -> dict:
    doc = copy.deepcopy(load_example("tiny-grpo-cpu-job.yaml"))
    doc["metadata"] = {"name": "tiny", "namespace": NAMESPACE, "uid": UID, "generation": generation}
    doc["spec"].update(spec)
    return doc


def test_a_generation_is_validated_once():
    first = reconcile._validated_job(body(1))
    assert reconcile._validated_job(body(1)) is first
    second = reconcile._validated_job(body(2, algorithm="rloo"))
    assert second is not first and second.spec.algorithm == "rloo"


def test_an_invalid_generation_is_refused_from_the_first_verdict():
    with pytest.raises(InvalidJob) as first:
        reconcile._validated_job(body(3, algorithm="nonsense"))
    with pytest.raises(InvalidJob) as again:
        reconcile._validated_job(body(3, algorithm="nonsense"))
    assert again.value is first.value
