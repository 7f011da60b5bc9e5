"""The algorithm catalogue is the one declaration: the CRD's enum and CEL lists agree with it."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import yaml

from rlhf_api import algorithms

CRD_FILE = Path(__file__).resolve().parents[1] / "crds" / "rlhf.dev_rlhfjobs.yaml"
# The catalogue's lists of algorithms (job.py builds every CEL list from one of them).
CATALOGUE_LISTS = {frozenset(names) for names in (
    algorithms.ONLINE, algorithms.GROUP_SAMPLES, algorithms.USES_CRITIC, algorithms.USES_BEST_OF_N,
    algorithms.ONE_STEP_PER_ROLLOUT, algorithms.USES_TEACHER, algorithms.NEEDS_REWARD, algorithms.CONDITIONED,
    algorithms.ALWAYS_REFERENCED, algorithms.STEP_LABELLED, algorithms.TAKES_IMAGES,
    *(algorithms.reading(dataset) for dataset in typing.get_args(algorithms.Dataset)))}


def spec_schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_crd_enum_is_the_catalogue():
    assert tuple(spec_schema()["properties"]["algorithm"]["enum"]) == algorithms.NAMES


def test_every_cel_list_of_algorithms_is_the_catalogue_s():
    """No rule lists algorithms by hand: each list is one the catalogue derives (what each rule means
    is tested by the invalid specs, tests/specs/invalid, and the admission fuzz)."""
    rules = [r["rule"] for r in spec_schema()["x-kubernetes-validations"]]
    lists = [frozenset(re.findall(r"'([^']+)'", listed)) for rule in rules
             for listed in re.findall(r"self\.algorithm in \[([^\]]*)\]", rule)]
    assert lists, "no rule names algorithms: the pattern no longer matches the generated rules"
    for names in lists:
        assert names in CATALOGUE_LISTS, f"{sorted(names)} is not a list the catalogue derives"


def test_each_entry_is_online_with_an_estimator_or_offline_with_an_objective():
    for entry in algorithms.CATALOGUE:
        assert (entry.advantage is not None) == entry.online == (entry.objective is None), entry.name
        assert entry.roles and (entry.roles[0] in ("actor", "rm")), entry.name
        assert not entry.group_samples or entry.online, entry.name
