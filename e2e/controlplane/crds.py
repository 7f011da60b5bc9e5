"""CustomResourceDefinitions: KubeRay's and Kueue's (from their builds) and the repo's crds/."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
import yaml

from .binaries import REPO, Binaries
from .client import Api, conditions
from .errors import ControlPlaneError
from .process import Launcher

CRDS_DIR = REPO / "crds"
FIELD_MANAGER = "rlhf-e2e"


def repo_crd_files(extra_paths: Iterable[Path]) -> list[Path]:
    """Every YAML in the repo's crds/ plus any extra paths given."""
    files = sorted(p for p in CRDS_DIR.glob("*.y*ml") if p.is_file()) if CRDS_DIR.is_dir() else []
    for extra in extra_paths:
        extra = Path(extra)
        files += sorted(extra.glob("*.y*ml")) if extra.is_dir() else [extra]
    return files


def kuberay_crd_files(binaries: Binaries) -> list[Path]:
    return sorted(binaries.kuberay_crds.glob("*.yaml"))


def kueue_crd_files(binaries: Binaries) -> list[Path]:
    # As kustomize's bases, without its conversion-webhook patches: nothing here reads the
    # older v1beta1, and a conversion webhook URL would tie the cached seed to one Kueue port.
    return sorted(binaries.kueue_crds.glob("*.yaml"))


def install_all(install: Callable[[Sequence[Path]], list[str]], required: Sequence[Path],
                repo_files: Sequence[Path], log: Callable[[str], None]
                ) -> tuple[list[str], dict[str, str]]:
    """The required CRDs (KubeRay's and Kueue's: must apply) and the repo's crds/ (each file on
    its own); returns the CRD names and, per refused repo file, the API server's refusal.

    A repo CRD the API server refuses does not stop the control plane: the refusal is
    kept (and logged) so only the tests that need that CRD fail, with the API server's message.
    """
    names = install(required)
    errors: dict[str, str] = {}
    for f in repo_files:
        try:
            names += install([f])
        except ControlPlaneError as e:
            errors[str(f)] = str(e)
            log(f"CRD {f} was refused by the API server:\n{e}")
    return names, errors


def install(kubectl: Callable[..., object], launch: Launcher, api: Api, files: Sequence[Path]
            ) -> list[str]:
    """Server-side apply CRD files (too big for client-side apply); wait until Established."""
    files = list(files)
    if not files:
        return []
    names = []
    for f in files:
        for doc in yaml.safe_load_all(Path(f).read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
                names.append(doc["metadata"]["name"])
    args = ["apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}"]
    for f in files:
        args += ["-f", str(f)]
    kubectl(*args)
    wait_established(launch, api, names)
    return names


def wait_established(launch: Launcher, api: Api, names: Sequence[str]) -> None:
    def established() -> bool:
        for name in names:
            status, crd = api.get_json(
                f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            if status != 200 or conditions(crd).get("Established") != "True":
                return False
        return True

    launch.wait(established, 60, f"CRDs Established: {', '.join(names)}")


def wait_admission_ready(launch: Launcher, api: Api, names: Sequence[str]) -> None:
    """Until a dry-run create of each CRD's kind gets past mutating admission. The API server's
    MutatingAdmissionPolicy plugin learns a CRD's schema by polling /openapi/v3 every 5 s; until
    it has, every create a policy matches is refused with 503 "Resource kind ... not found",
    whatever the policy's failurePolicy (apiserver's policy/mutating/dispatcher.go). That window
    opens at every API server start, so it is waited out after a start or a restart, once the
    policies are in. Any other answer (201, 422 for the bare object) means admission is through."""
    probes = []  # (dry-run create path, bare object) per served version
    for name in names:
        spec = api.get_json(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")[1]["spec"]
        scope = "/namespaces/default" if spec["scope"] == "Namespaced" else ""
        for version in (v["name"] for v in spec["versions"] if v.get("served")):
            probes.append((
                f"/apis/{spec['group']}/{version}{scope}/{spec['names']['plural']}?dryRun=All",
                {"apiVersion": f"{spec['group']}/{version}", "kind": spec["names"]["kind"],
                 "metadata": {"name": "admission-probe"}}))

    def admitted() -> bool:
        return all(api.request("POST", path, body, ok=())[0] not in (0, 503) for path, body in probes)

    launch.wait(admitted, 60, f"dry-run creates of {', '.join(names)} past mutating admission")
