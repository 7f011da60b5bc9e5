"""A model on a PersistentVolumeClaim: the trainer loads it from exactly where the operator mounts it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from e2e.pods.volumes import bind_script
from rlhf_api.paths import model_path
from rlhf_api.validation import validate
from rlhf_operator import render

JOB = {
    "apiVersion": "rlhf.dev/v1alpha1",
    "kind": "RLHFJob",
    "metadata": {"name": "pvc-model", "namespace": "ml", "uid": "0000-pvc"},
    "spec": {
        "algorithm": "dpo",
        "models": {"actor": {"path": "tiny", "pvc": {"claimName": "models", "subPath": "team-a"}}},
        "data": {"preferences": {"sources": [{"path": "pairs.jsonl"}]}},
    },
}


def head_mount(job, volume_claim: str) -> dict:
    """The head container's mount of the volume backed by volume_claim."""
    pod = render.ray_job(job)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == volume_claim]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    return mount


def test_the_trainer_resolves_the_path_the_operator_mounts(tmp_path):
    job = validate(JOB)
    mount = head_mount(job, "models")
    assert mount["subPath"] == "team-a" and mount["readOnly"] is True
    for role in ("actor", "reference", "rm"):  # the reference and rm default to the actor's model
        assert model_path(job.spec.models, role, tmp_path) == f"{mount['mountPath']}/tiny"


def test_a_model_on_a_pvc_loads_in_the_trainer(tmp_path, tiny_model):
    """The volume's directory bound at the mount path as a kubelet would (subPath included), in a
    private mount namespace; the trainer's model_path then finds and loads the model there."""
    volume = tmp_path / "volume"  # the PersistentVolume's root
    (volume / "team-a").mkdir(parents=True)
    (volume / "team-a" / "tiny").symlink_to(tiny_model)
    job = validate(JOB)
    mount = head_mount(job, "models")
    load = ("import sys; from pathlib import Path; from rlhf_api.validation import validate; "
            "from rlhf_api.paths import model_path; from transformers import AutoModelForCausalLM; "
            f"job = validate({JOB!r}); path = model_path(job.spec.models, 'actor', Path('/nonexistent')); "
            "model = AutoModelForCausalLM.from_pretrained(path); print(path, model.num_parameters())")
    script = f"set -e\n{bind_script([(volume / mount['subPath'], mount['mountPath'])])}exec {sys.executable} -c \"{load}\"\n"
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    path, parameters = result.stdout.split()[-2:]
    assert path == f"{mount['mountPath']}/tiny" and int(parameters) > 0
    assert not Path(mount["mountPath"]).exists() or not any(Path(mount["mountPath"]).iterdir())  # host untouched
