"""Pipelines of RLHFJobs: a model of one job (models.<role>.fromJob) is the model another job exported.

Written once for both places that run a pipeline: the operator (the job waits for its input to
succeed, then loads the input's model from the input's checkpoint claim: `output_model`, `problem`,
`on_claims`) and `rlhf run` of several job files (the stages in dependency order, `in_order`, each loading
the models of the stages before it from their output directories: `at_paths`).
"""

from __future__ import annotations

from typing import Literal

from . import v1alpha1 as api
from .algorithms import ALGORITHMS

Kind = Literal["policy", "reward"]
# What each role loads: a causal LM, or a sequence classifier (a critic starts from either: a value head
# is added to a policy, as when it defaults to the actor).
ACCEPTS: dict[str, tuple[Kind, ...]] = {
    "actor": ("policy",), "reference": ("policy",), "teacher": ("policy",),
    "reward": ("reward",), "critic": ("reward", "policy"),
}


def exported_kind(spec: api.RLHFJobSpec) -> Kind:
    """An rm job trains a reward model; every other algorithm a policy."""
    return "reward" if ALGORITHMS[spec.algorithm].roles[0] == "rm" else "policy"


def inputs(spec: api.RLHFJobSpec) -> dict[str, api.JobModelRef]:
    """The roles whose model is another job's, by role."""
    return {role: model.from_job for role, model in spec.models if model is not None and model.from_job is not None}


def unexported(spec: api.RLHFJobSpec, *, on_a_claim: bool = True) -> str | None:
    """Why a job's model cannot be another job's input (None: it can): it must be exported, as a model, and
    on a cluster where a pod of another job can read it (on_a_claim)."""
    if on_a_claim and not spec.checkpoint.pvc:
        return "it has no spec.checkpoint.pvc, so its model stays in its own pods"
    if not spec.checkpoint.export_hf:
        return "it sets checkpoint.exportHf: false, so it exports no model"
    lora = spec.models.actor.lora
    if lora is not None and not lora.export_merged:
        return "it trains LoRA adapters without lora.exportMerged, so it exports an adapter, not a model"
    return None


def exported_dir(spec: api.RLHFJobSpec, model: Literal["final", "best"]) -> str:
    """The directory, under the job's checkpoint.path, of its exported model (a LoRA actor's merged copy)."""
    return model + ("/merged" if spec.models.actor.lora is not None else "")


def output_model(name: str, spec: api.RLHFJobSpec, step: int | None, best: bool) -> api.OutputModel | None:
    """Where a succeeded job's model is (status.outputModel); None when it exported none (`unexported`).
    best: it kept a best checkpoint (spec.evaluation.bestMetric)."""
    if unexported(spec) is not None:
        return None
    return api.OutputModel(claim_name=spec.checkpoint.pvc, sub_path=name, final=exported_dir(spec, "final"),
                           best=exported_dir(spec, "best") if best else None, kind=exported_kind(spec), step=step)


def problem(role: str, ref: api.JobModelRef, kind: Kind, has_best: bool) -> str | None:
    """Why the input job's exported model (of that kind; with a best checkpoint or not) cannot be this
    role's (None: it can)."""
    if kind not in ACCEPTS[role]:
        wanted = " or ".join(ACCEPTS[role])
        return (f"models.{role}.fromJob: RLHFJob {ref.name} exported a {kind} model, and the {role} loads a "
                f"{wanted} model: name a job of another algorithm (rm gives reward models, the others policies)")
    if ref.model == "best" and not has_best:
        return (f"models.{role}.fromJob asks for RLHFJob {ref.name}'s best model, and it kept none (it has no "
                "spec.evaluation.bestMetric): ask for model: final")
    return None


def on_claims(spec: api.RLHFJobSpec, outputs: dict[str, api.OutputModel]) -> api.RLHFJobSpec:
    """The spec with each fromJob model the input's exported model on its claim (`outputs`: the inputs'
    status.outputModel by role), as a cluster's pods and trainer read it."""
    return _resolved(spec, {role: {
        "path": outputs[role].final if ref.model == "final" else outputs[role].best,
        "pvc": api.PVCSource(claim_name=outputs[role].claim_name, sub_path=outputs[role].sub_path),
    } for role, ref in inputs(spec).items()})


def at_paths(spec: api.RLHFJobSpec, paths: dict[str, str]) -> api.RLHFJobSpec:
    """The spec with each fromJob model at a directory of this machine (`paths` by role): `rlhf run`'s stages."""
    return _resolved(spec, {role: {"path": path} for role, path in paths.items()})


def _resolved(spec: api.RLHFJobSpec, updates: dict[str, dict]) -> api.RLHFJobSpec:
    models = spec.models.model_copy()
    for role, update in updates.items():
        setattr(models, role, getattr(models, role).model_copy(update={"from_job": None, **update}))
    return spec.model_copy(update={"models": models})


class Cycle(ValueError):
    """Jobs that name each other's models, directly or through others: none of them can ever start."""


def in_order(specs: dict[str, api.RLHFJobSpec]) -> list[str]:
    """The job names, each after every job it names in a fromJob (those outside `specs` are not waited
    for here). Raises Cycle naming the jobs of a cycle."""
    done: list[str] = []
    visiting: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in visiting:
            cycle = visiting[visiting.index(name):] + [name]
            raise Cycle(f"the jobs name each other's models in a cycle ({' <- '.join(cycle)}): none of them "
                        "could ever start; make one of them start from a path")
        visiting.append(name)
        for ref in inputs(specs[name]).values():
            if ref.name in specs:
                visit(ref.name)
        visiting.pop()
        done.append(name)

    for name in specs:
        visit(name)
    return done
