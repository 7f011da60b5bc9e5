"""Sequence parallelism (training.sequenceParallel, workers/sequence_parallel.py) on 2 gloo ranks equals one rank.

One pair of processes (this file run as a script, one per rank) splits every row over both ranks; this
process computes the one-rank run meanwhile, as the only rank of its own group. Both run the real
Model in a DeepSpeed engine (ZeRO-0, float32) on the same micro-batches of unequal lengths, one of them a
single-token sample (its row is shorter than the 2 ranks), for the actor (packed rows: the
scoring pass packs all four samples into rows, the training micro-batches hold one sample each) and the
critic (padded rows), under sdpa and eager. Compared: the log-probs or values of every token, each
micro-batch's loss of the first step, the gradients of the first optimizer step, the weights after 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
from rlhf_trainer.experience import Experience
from rlhf_trainer.workers.engine import ModelConfig

pytestmark = pytest.mark.timeout(300)

RANKS = 2
# attention, role, LoRA adapters (the split touches attention and the token layout only: adapters train alike),
# ZeRO stage (ZeRO-3 shards over both ranks and reduces the gradients its own way: its default reduce-scatter
# averaged them over all ranks, halving them; the clipped critic's weights then drifted by 1.5e-4)
CASES = [(attention, role, False, 0) for attention in ("sdpa", "eager") for role in ("actor", "critic")]
CASES += [("sdpa", "actor", True, 0), ("sdpa", "critic", False, 3)]
NAMES = [f"{attention}-{role}" + ("-lora" if lora else "") + f"-zero{stage}" for attention, role, lora, stage in CASES]
TOLERANCE = 1e-5  # the largest difference over the largest entry, float32
STEPS = 3
# Adam steps a weight by about the learning rate whatever its gradient's size, and float32 sums in another
# order (the ranks' shares) leave each gradient about 1e-6 of its largest entry off (seen: 4e-7 to 2e-6): a
# near-zero entry's step can come out anywhere within +-lr. The weights are therefore compared over the whole
# model (the largest difference over the largest weight; per tensor, the q/k/v biases that start at 0 are all
# such steps): at 1e-4 the 3 steps move the weights by 3e-4 of the largest (asserted: they move) and the
# noise stays near 2e-6; at 1e-3 it reached 3e-4.
LEARNING_RATE = 1e-4


def _experience() -> Experience:
    """Four samples laid out as the trainer lays them out (prompts left-padded, responses right-padded):
    11, 6, 5 and 1 tokens long; the last is a one-token prompt whose response is all padding."""
    prompts, responses = [5, 4, 3, 1], [6, 2, 2, 0]
    generator = torch.Generator().manual_seed(0)
    width_p, width_r = max(prompts), max(responses)
    prompt_mask = torch.arange(width_p) >= width_p - torch.tensor(prompts)[:, None]
    action_mask = torch.arange(width_r) < torch.tensor(responses)[:, None]
    attention_mask = torch.cat([prompt_mask, action_mask], 1)
    sequences = torch.randint(3, 300, attention_mask.shape, generator=generator) * attention_mask
    return Experience(
        sequences=sequences, attention_mask=attention_mask.long(), action_mask=action_mask,
        action_log_probs=-torch.rand(len(prompts), width_r, generator=generator) - 5.0,
        advantages=torch.randn(len(prompts), width_r, generator=generator),
        values=torch.randn(len(prompts), width_r, generator=generator),
        returns=torch.randn(len(prompts), width_r, generator=generator),
    )


def _config(path: str, role: str, attention: str, lora: bool, stage: int, split: int) -> ModelConfig:
    training = TrainingSpec(
        zero_stage=stage, bf16=False, learning_rate=LEARNING_RATE, critic_learning_rate=LEARNING_RATE, lr_warmup_ratio=0,
        lr_scheduler="constant", train_batch_size=4, micro_train_batch_size=1, micro_rollout_batch_size=4,
        max_grad_norm=1.0, entropy_coef=0.01, sequence_parallel={"size": split})
    model = ModelSpec(path=path, dtype="float32", attn_implementation=attention, lora={"rank": 8} if lora else None)
    return ModelConfig(role=role, path=path, model=model,
                       training=training, optimizer_steps=STEPS, max_new_tokens=6)


def run_case(path: str, attention: str, role: str, lora: bool, stage: int, split: int, rank: int,
             world_size: int) -> dict:
    """The passes of one model: reads of every token, the first step's losses and gradients (ZeRO-0: whole on each
    rank), the gradient norm of each step, the weights after STEPS optimizer steps of the same 4 micro-batches."""
    from rlhf_trainer.workers.engine import load_model
    from rlhf_trainer.workers.group import micro_batches_per_rank
    from rlhf_trainer.workers.objectives import policy_step, value_step
    from rlhf_trainer.workers.weights import state_dict

    torch.manual_seed(0)  # the critic's score head
    model = load_model(_config(path, role, attention, lora, stage, split), rank, world_size)
    experience = _experience()
    initial = state_dict(model)  # whole, on rank 0 (a collective under ZeRO-3)
    with model.scoring(), torch.no_grad():
        read = model.action_log_probs if role == "actor" else model.action_values
        reads = read(experience.sequences, experience.attention_mask, experience.num_actions)
    grads: list[dict] = []
    if stage == 0:
        model.engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.append(
            {name: p.grad.clone() for name, p in model.engine.module.named_parameters() if p.grad is not None}))
    step = policy_step if role == "actor" else value_step
    [micro_batches] = micro_batches_per_rank(experience, 1, train_batch_size=4, micro_batch_size=1, epochs=1,
                                             generator=torch.Generator().manual_seed(0))
    losses = [[step(model, batch) for batch in micro_batches] for _ in range(STEPS)]
    assert len(model.grad_norms) == STEPS, f"{len(model.grad_norms)} optimizer steps, not {STEPS}"
    weights = state_dict(model)
    return {"reads": reads, "losses": losses[0], "grads": grads[:1], "norms": model.grad_norms, "weights": weights,
            "moved": model_relative_difference(weights, initial) if rank == 0 else None,
            "real": experience.attention_mask.bool()}


def _rank_main(rank: int, store_path: str, path: str, out: str) -> None:
    from rlhf_trainer.workers.distributed import init_distributed

    store = torch.distributed.FileStore(store_path, RANKS)
    init_distributed(rank, RANKS, store, use_gpu=False)
    results = {name: run_case(path, *case, RANKS, rank, RANKS) for name, case in zip(NAMES, CASES)}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def relative_difference(split, whole) -> float:
    """max |split - whole| over max |whole|, over every tensor or number of the nested structure."""
    if isinstance(whole, dict):
        return max(relative_difference(split[key], whole[key]) for key in whole)
    if isinstance(whole, list):
        return max((relative_difference(a, b) for a, b in zip(split, whole)), default=0.0)
    split, whole = torch.as_tensor(split, dtype=torch.float64), torch.as_tensor(whole, dtype=torch.float64)
    return float((split - whole).abs().max() / whole.abs().max().clamp(min=1e-30))


def model_relative_difference(split: dict, whole: dict) -> float:
    """max |split - whole| over max |whole|, each over all the model's weights."""
    return (max(float((split[name] - whole[name]).abs().max()) for name in whole)
            / max(float(weight.abs().max()) for weight in whole.values()))


@pytest.fixture(scope="module")
def split_and_whole(tiny_model, tmp_path_factory):
    """{case: (rank 0's results, rank 1's, the one-rank results)}."""
    from rlhf_trainer.workers.distributed import COLLECTIVE_TIMEOUT, init_distributed, open_store
    from rlhf_trainer.workers.threads import CPU_ENV

    out = tmp_path_factory.mktemp("sequence-parallel")
    ranks = [subprocess.Popen([sys.executable, __file__, str(rank), str(out / "store"), str(tiny_model), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **CPU_ENV, "OMP_NUM_THREADS": "1"})  # a core each, asleep in gloo
             for rank in range(RANKS)]
    saved = dict(os.environ)
    try:
        init_distributed(0, 1, open_store(1, COLLECTIVE_TIMEOUT), use_gpu=False)
        whole = {name: run_case(str(tiny_model), *case, 1, 0, 1) for name, case in zip(NAMES, CASES)}
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    for rank in ranks:
        output, _ = rank.communicate(timeout=240)
        assert rank.returncode == 0, output[-4000:]
    split = [torch.load(out / f"rank{rank}.pt") for rank in range(RANKS)]
    return {case: (split[0][case], split[1][case], whole[case]) for case in whole}


@pytest.mark.parametrize("case", NAMES)
def test_two_ranks_splitting_every_row_train_as_one_rank(split_and_whole, case):
    first, second, whole = split_and_whole[case]
    real = whole["real"][:, -whole["reads"].shape[1]:]  # a padded row's padding reads nothing
    differences = {
        "reads": relative_difference(first["reads"][real], whole["reads"][real]),
        "losses": relative_difference(first["losses"], whole["losses"]),
        "grads": relative_difference(first["grads"], whole["grads"]) if whole["grads"] else 0.0,
        "norms": relative_difference(first["norms"], whole["norms"]),
        "weights": model_relative_difference(first["weights"], whole["weights"]),
    }
    print(case, differences)
    assert max(differences.values()) <= TOLERANCE, differences
    assert whole["moved"] > 10 * TOLERANCE, "the weights must move for their comparison to say anything"
    shared = ("reads", "losses", "grads", "norms")  # the weights come whole to rank 0 only
    assert relative_difference([second[key] for key in shared], [first[key] for key in shared]) == 0.0, \
        "the ranks of a sequence-parallel group disagree"


SPLIT = {"training.sequenceParallel": {"size": 2}, "resources.gpus": {"actor": 2, "reference": 2}}


def _tiny_job(**changes) -> dict:
    """The tiny CPU example with its actor and reference split over 2 ranks each (valid), and `changes`."""
    import yaml

    manifest = yaml.safe_load((Path(__file__).resolve().parents[2] / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    for dotted, value in {**SPLIT, **changes}.items():
        *parents, key = dotted.split(".")
        node = manifest["spec"]
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = value
    return manifest


@pytest.mark.parametrize("changes, path, fix", [
    ({"resources.gpus": {"actor": 3, "reference": 2}}, "spec.resources.gpus.actor", "make resources.gpus.actor a multiple"),
    ({"resources.gpus": {"reference": 2}}, "spec.resources.gpus.actor", "set resources.gpus.actor (and every other"),
    ({"training.tensorParallel": {"size": 2}}, "spec.training.tensorParallel.size", "use one of them"),
    ({"data.prompts.imageKey": "image"}, "spec.training.sequenceParallel.size", "vision-language model's passes"),
], ids=["ranks", "cpu-ranks", "with-autotp", "images"])
def test_admission_refuses_what_sequence_parallelism_cannot_split_with_the_fix(changes, path, fix):
    """The CEL rules the API server and `rlhf validate` apply."""
    from rlhf_api.validation import InvalidJob, validate

    validate(_tiny_job())
    with pytest.raises(InvalidJob) as refused:
        validate(_tiny_job(**changes))
    assert any(error.path == path and fix in error.message for error in refused.value.errors), refused.value.errors


def test_the_trainer_refuses_splits_the_heads_or_the_placed_ranks_do_not_divide(toy_job, tmp_path):
    """The tiny model has 4 attention heads and 2 key-value heads: 2 ranks split it, 4 do not; a reference left to
    the automatic placement (one rank on CPU) forms no group of 2 (checks.py, before Ray or any model starts)."""
    from rlhf_api.validation import InvalidJob, validate
    from rlhf_trainer.checks import check

    def spec(size: int, gpus: dict):
        import yaml

        job = toy_job(**{"training.sequenceParallel": {"size": size}, "resources.gpus": gpus})
        return validate(yaml.safe_load(job.read_text())).spec

    placement = check(spec(2, {"actor": 2, "reference": 2}), tmp_path)
    assert len(placement.ranks["actor"]) == len(placement.ranks["reference"]) == 2
    with pytest.raises(InvalidJob) as refused:
        check(spec(4, {"actor": 4, "reference": 4}), tmp_path)
    assert [(e.path, e.message) for e in refused.value.errors] == [("spec.training.sequenceParallel.size", (
        f"{role}: the model has 2 key-value heads, which sequence parallelism (DeepSpeed-Ulysses: each rank attends "
        "with 1/size of them) cannot split over 4 ranks: set training.sequenceParallel.size to a divisor of 2"))
        for role in ("actor", "reference")]
    with pytest.raises(InvalidJob) as refused:
        check(spec(2, {"actor": 2}), tmp_path)
    assert [e.path for e in refused.value.errors] == ["spec.resources.gpus.reference"]


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), *sys.argv[2:])
