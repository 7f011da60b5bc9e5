"""A job with its runtime applied: the runtime's settings where the job leaves a field at its default.

Field by field, recursively into sections (resources.head's cpu apart from its memory): a job's own value wins
when it differs from the field's default. A job cannot tell the API server "the default, not the runtime's":
the API server fills every default before anyone reads the job; to insist on a default value, a platform team
leaves the field out of the runtime.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .v1alpha1 import RLHFJobSpec, ResourcesSpec
from .v1alpha1.runtime import RUNTIME_RESOURCES, RLHFRuntimeSpec


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].get_default(call_default_factory=True)


def _filled(own: BaseModel, theirs: BaseModel, names: tuple[str, ...] | list[str]) -> BaseModel:
    """`own` with `theirs`' value of each named field that `own` leaves at its default."""
    updates = {}
    for name in names:
        value, given = getattr(own, name), getattr(theirs, name)
        if given is None:
            continue
        if isinstance(value, BaseModel) and isinstance(given, BaseModel):
            updates[name] = _filled(value, given, list(type(value).model_fields))
        elif value == _default(type(own), name):
            updates[name] = given
    return own.model_copy(update=updates)


def applied(spec: RLHFJobSpec, runtime: RLHFRuntimeSpec) -> RLHFJobSpec:
    """The job's spec as the runtime completes it (its trainer image by the job's device)."""
    resources = _filled(spec.resources, runtime.resources, RUNTIME_RESOURCES)
    if resources.image is None and runtime.trainer_images is not None:
        images = runtime.trainer_images
        resources = resources.model_copy(update={"image": images.cuda if resources.gpus_per_node else images.cpu})
    queue = spec.queue_name or runtime.queue_name
    return spec.model_copy(update={"resources": resources, "queue_name": queue})


def locked_fields_set(spec: RLHFJobSpec, runtime: RLHFRuntimeSpec) -> list[str]:
    """The fields the runtime locks that the job sets itself (spec paths)."""
    by_alias = {ResourcesSpec.model_fields[name].alias: name for name in RUNTIME_RESOURCES}
    found = []
    for alias in runtime.locked:
        if alias == "queueName":
            if spec.queue_name is not None:
                found.append("spec.queueName")
        elif getattr(spec.resources, by_alias[alias]) != _default(ResourcesSpec, by_alias[alias]):
            found.append(f"spec.resources.{alias}")
    return found
