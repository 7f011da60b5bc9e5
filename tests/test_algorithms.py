"""The algorithm catalogue is the one declaration: the CRD's enum and CEL lists agree with it."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from rlhf_api import algorithms

CRD_FILE = Path(__file__).resolve().parents[1] / "crds" / "rlhf.dev_rlhfjobs.yaml"
# What a CEL rule guards -> the catalogue's algorithms it must list.
GUARDS = {
    "has(self.data.prompts)": algorithms.ONLINE,
    "|| has(self.reward)": algorithms.ONLINE,
    "!has(self.reward)": algorithms.ONLINE,
    "!has(self.environment)": algorithms.ONLINE,
    "!has(self.evaluation)": algorithms.ONLINE,
    "rolloutBatchSize": algorithms.ONLINE,
    "has(self.data.preferences)": algorithms.reading("preferences"),
    "has(self.data.sft)": algorithms.reading("sft"),
    "samplesPerPrompt > 1": algorithms.GROUP_SAMPLES,
    "has(self.models.critic)": algorithms.USES_CRITIC,
}


def spec_schema() -> dict:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_crd_enum_is_the_catalogue():
    assert tuple(spec_schema()["properties"]["algorithm"]["enum"]) == algorithms.NAMES


def test_every_cel_list_of_algorithms_is_the_catalogue_s():
    checked = set()
    for rule in (r["rule"] for r in spec_schema()["x-kubernetes-validations"]):
        lists = re.findall(r"self\.algorithm in \[([^\]]*)\]", rule)
        if not lists:
            continue
        (listed,) = lists
        names = set(re.findall(r"'([^']+)'", listed))
        guard = next(g for g in GUARDS if g in rule)
        assert names == set(GUARDS[guard]), f"{rule!r} lists {sorted(names)}, the catalogue {sorted(GUARDS[guard])}"
        checked.add(guard)
    assert checked == set(GUARDS), f"rules no longer found: {set(GUARDS) - checked}"


def test_each_entry_is_online_with_an_estimator_or_offline_with_an_objective():
    for entry in algorithms.CATALOGUE:
        assert (entry.advantage is not None) == entry.online == (entry.objective is None), entry.name
        assert entry.roles and (entry.roles[0] in ("actor", "rm")), entry.name
        assert not entry.group_samples or entry.online, entry.name
