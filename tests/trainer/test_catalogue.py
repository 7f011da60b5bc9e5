"""Every key the algorithm catalogue (rlhf_api.algorithms) names is one the trainer has registered:
an online algorithm's advantage estimator, an offline algorithm's objective and its training step,
every algorithm's default loss aggregation (and the API's lossAggregation enum is the registry)."""

from __future__ import annotations

import typing

import pytest

from rlhf_api.algorithms import CATALOGUE
from rlhf_api.v1alpha1.training import LossAggregation
from rlhf_trainer.algorithms import ADVANTAGE_ESTIMATORS
from rlhf_trainer.losses import LOSS_AGGREGATIONS
from rlhf_trainer.offline import OBJECTIVES
from rlhf_trainer.workers.objectives import NORMALIZERS, OFFLINE_STEPS

ONLINE = [a for a in CATALOGUE if a.online]
OFFLINE = [a for a in CATALOGUE if not a.online]


@pytest.mark.parametrize("algorithm", ONLINE, ids=lambda a: a.name)
def test_online_algorithm_names_a_registered_advantage_estimator(algorithm):
    assert algorithm.advantage in ADVANTAGE_ESTIMATORS


@pytest.mark.parametrize("algorithm", OFFLINE, ids=lambda a: a.name)
def test_offline_algorithm_names_an_objective_whose_step_is_registered(algorithm):
    assert algorithm.objective in OBJECTIVES
    assert OBJECTIVES[algorithm.objective].step in OFFLINE_STEPS


def test_every_objective_and_step_is_used_by_the_catalogue():
    used = {a.objective for a in OFFLINE}
    assert used == set(OBJECTIVES)
    assert {OBJECTIVES[key].step for key in used} == set(OFFLINE_STEPS)


@pytest.mark.parametrize("algorithm", CATALOGUE, ids=lambda a: a.name)
def test_algorithm_defaults_to_a_registered_loss_aggregation(algorithm):
    assert algorithm.loss_aggregation in LOSS_AGGREGATIONS


def test_the_api_s_loss_aggregations_are_the_registry_s():
    assert set(typing.get_args(LossAggregation)) == set(LOSS_AGGREGATIONS)
    assert set(NORMALIZERS) <= set(LOSS_AGGREGATIONS)
