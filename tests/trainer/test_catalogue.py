"""Every key the algorithm catalogue (rlhf_api.algorithms) names is one the trainer has registered:
an online algorithm's advantage estimator and policy loss, an offline algorithm's objective and its
training step, every algorithm's default loss aggregation (and the API's lossAggregation enum is the
registry); the training fields defaulted per algorithm have no constant default of their own."""

from __future__ import annotations

import typing

import pytest

from rlhf_api.algorithms import CATALOGUE, TRAINING_DEFAULTS
from rlhf_api.v1alpha1 import TrainingSpec
from rlhf_api.v1alpha1.training import LossAggregation
from rlhf_trainer.algorithms import ADVANTAGE_ESTIMATORS
from rlhf_trainer.losses import LOSS_AGGREGATIONS, POLICY_LOSSES
from rlhf_trainer.offline import OBJECTIVES
from rlhf_trainer.workers.objectives import NORMALIZERS, OFFLINE_STEPS

ONLINE = [a for a in CATALOGUE if a.online]
OFFLINE = [a for a in CATALOGUE if not a.online]


@pytest.mark.parametrize("algorithm", ONLINE, ids=lambda a: a.name)
def test_online_algorithm_names_a_registered_advantage_estimator(algorithm):
    assert algorithm.advantage in ADVANTAGE_ESTIMATORS
    assert algorithm.policy_loss in POLICY_LOSSES


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
    assert algorithm.training_defaults["lossAggregation"] in LOSS_AGGREGATIONS


@pytest.mark.parametrize("algorithm", CATALOGUE, ids=lambda a: a.name)
def test_algorithm_defaults_are_valid_training_values(algorithm):
    """Each declared default names a training field the API leaves unset (so that it can follow the
    algorithm) and is a value the field accepts."""
    assert set(algorithm.defaults) <= set(TRAINING_DEFAULTS)
    fields = {f.alias: f for f in TrainingSpec.model_fields.values()}
    assert all(fields[name].default is None for name in TRAINING_DEFAULTS)
    TrainingSpec.model_validate(algorithm.training_defaults, by_name=False)


def test_the_api_s_loss_aggregations_are_the_registry_s():
    assert set(typing.get_args(LossAggregation)) == set(LOSS_AGGREGATIONS)
    assert set(NORMALIZERS) <= set(LOSS_AGGREGATIONS)
