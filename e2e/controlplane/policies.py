"""The chart's admission policies (Validating- and MutatingAdmissionPolicies and their bindings) as manifests/install.yaml
renders them: the tests run under the admission an installed cluster has (the trainer's status writes
go through the chart's trainer-status policy). Not in the etcd seed: applying them takes a fraction
of a second, and a changed chart needs no new seed."""

from __future__ import annotations

from collections.abc import Callable

import yaml

from .binaries import REPO
from .crds import FIELD_MANAGER

INSTALL = REPO / "manifests" / "install.yaml"
KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
         "MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding")


def install(kubectl: Callable[..., object]) -> None:
    docs = [doc for doc in yaml.load_all(INSTALL.read_text(), Loader=yaml.CSafeLoader)
            if isinstance(doc, dict) and doc.get("kind") in KINDS]
    if docs:
        kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}", "-f", "-",
                input=yaml.safe_dump_all(docs))
