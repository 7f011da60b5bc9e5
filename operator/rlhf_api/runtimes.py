"""A job with its runtime applied: the runtime's settings where the job leaves a field at its default.

Field by field, recursively into sections (resources.head's cpu apart from its memory): a job's own value wins
when it differs from the field's default. A job cannot tell the API server "the default, not the runtime's":
the API server fills every default before anyone reads the job; to insist on a default value, a platform team
leaves the field out of the runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel

from .v1alpha1 import RLHFJobSpec, ResourcesSpec
from .v1alpha1.runtime import CLUSTER_RUNTIME_KIND, RUNTIME_KIND, RUNTIME_RESOURCES, RLHFRuntimeSpec


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


def default_runtime(runtimes: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """Of runtime manifests (each with its kind), the one a job that names none gets: a namespace's RLHFRuntime
    marked default before a ClusterRLHFRuntime marked default; among several marked, the oldest, so that marking a
    second one (a platform team's handover) changes nothing until the first is unmarked. One not created yet (a
    file given to `rlhf validate`) counts as the newest; equal ages go by name. The operator, its admission webhook
    and `rlhf validate` all pick with this."""
    marked = [runtime for runtime in runtimes if (runtime.get("spec") or {}).get("default")]
    for kind in (RUNTIME_KIND, CLUSTER_RUNTIME_KIND):
        if of_kind := [runtime for runtime in marked if runtime.get("kind") == kind]:
            return min(of_kind, key=_oldest_first)
    return None


def _oldest_first(runtime: Mapping[str, Any]) -> tuple[bool, str, str]:
    meta = runtime.get("metadata") or {}
    created = meta.get("creationTimestamp")  # RFC 3339 in UTC: its text sorts as its time
    return created is None, created or "", meta.get("name") or ""
