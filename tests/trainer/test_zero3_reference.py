"""Two optimizer steps of the actor through a real 2-rank ZeRO-3 ModelWorker group (gloo, float32)
give the weights one process gets with plain torch AdamW on the same loss of the same batch.

The reference builds each step's loss from the public loss functions (PPO-clip, the KL term in the
loss and the entropy bonus, token-mean over all the step's valid tokens), backpropagates it through
plain transformers, clips the gradient norm and steps torch.optim.AdamW with the trainer's betas
(0.9, 0.95), learning rate and weight decay. What it checks that the maths alone does not: the split
into micro-batches and ranks, each micro-batch's normaliser against DeepSpeed's division by the
accumulation steps and the ranks' averaging, ZeRO-3's gradient clipping over sharded gradients, and
AdamW's settings.

Adam is blind to a gradient scaled alike at every step, so the two steps are made to differ: the
second step's advantages are a tenth of the first's, and the clipping norm lies between their
gradient norms, so the clip acts on the first step only. A gradient twice or half as large (a
missing or doubled division by the accumulation steps), no clipping or a wrong clipping norm then
changes the ratio of the two steps' gradients and so the second Adam update. The test first checks
that each such slip, run through the reference, lands far outside its tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import remove_placement_group
from transformers import AutoModelForCausalLM

from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
from rlhf_trainer.algorithms import compute_kl, kl_in_loss
from rlhf_trainer.experience import Experience
from rlhf_trainer.losses import entropy_bonus, entropy_from_logits, ppo_policy_loss, token_log_probs
from rlhf_trainer.workers.engine import ModelConfig
from rlhf_trainer.workers.group import ModelGroup, create_placement_group, micro_batches_per_rank

pytestmark = pytest.mark.timeout(300)

RANKS, BATCH, MICRO = 2, 8, 2  # 2 micro-batches per rank per optimizer step (gradient accumulation)
LR, WEIGHT_DECAY, TEMPERATURE = 1e-3, 0.1, 0.7
KL = dict(coef=0.1, estimator="k3", placement="loss")
ENTROPY_COEF = 0.01
ADVANTAGE_SCALES = (1.0, 0.1)  # per optimizer step: see the module's docstring
# _distance's bound: float32 rounding gave 3.5e-4 (measured), in the k_proj biases, whose gradient is
# zero in exact arithmetic (softmax ignores a shift common to all keys) so that Adam scales rounding
# noise up to full steps; elsewhere below 1e-4. Each slip of SLIPS gave 0.1 to 0.5 (measured).
TOLERANCE = 5e-3


@dataclass(frozen=True)
class Reference:
    """How the single-process reference trains: by default the trainer's maths; otherwise a slip."""

    grad_scale: float = 1.0  # 2 or 0.5: a division by the accumulation steps doubled or missing
    clip: bool = True
    weight_decay: float = WEIGHT_DECAY
    micro_batch_mean: bool = False  # token-mean over each micro-batch's tokens, not the step's


SLIPS = {
    "gradient doubled": Reference(grad_scale=2.0),
    "gradient halved": Reference(grad_scale=0.5),
    "no clipping": Reference(clip=False),
    "no weight decay": Reference(weight_decay=0.0),
    "token-mean per micro-batch": Reference(micro_batch_mean=True),
}


def _load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _log_probs_and_logits(model, exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' log-probs [B, T] at the sampling temperature, and the logits they come
    from. No position ids: Qwen2's rotary positions are relative, a row's left padding shifts all alike."""
    logits = model(input_ids=exp.sequences, attention_mask=exp.attention_mask).logits
    logits = logits[:, -exp.num_actions - 1:-1] / TEMPERATURE
    return token_log_probs(logits, exp.sequences[:, -exp.num_actions:]), logits


def _steps(path: Path) -> list[Experience]:
    """One Experience of BATCH rows per optimizer step: prompts of 2-6 tokens, responses of 1-5
    (micro-batches hold different token counts), old log-probs those of the initial model, reference
    log-probs a little off them."""
    generator = torch.Generator().manual_seed(0)
    model = _load(path).eval()
    steps = []
    for scale in ADVANTAGE_SCALES:
        rows = []
        for _ in range(BATCH):
            prompt, response = (int(n) for n in torch.randint(1, 6, (2,), generator=generator))
            sequences = torch.randint(3, model.config.vocab_size, (1, prompt + 1 + response), generator=generator)
            zeros = torch.zeros(1, response)
            rows.append(Experience(sequences=sequences, attention_mask=torch.ones_like(sequences),
                                   action_mask=torch.ones(1, response, dtype=torch.bool), action_log_probs=zeros,
                                   base_action_log_probs=zeros, advantages=zeros))
        exp = Experience.concat(rows, pad_token_id=model.config.pad_token_id)
        with torch.no_grad():
            old, _ = _log_probs_and_logits(model, exp)
        noise = torch.randn(2, *exp.action_mask.shape, generator=generator)
        steps.append(replace(exp, action_log_probs=old, base_action_log_probs=old + 0.1 * noise[0],
                             advantages=scale * noise[1]))
    return steps


def _split(exp: Experience, step: int) -> list[list[Experience]]:
    """The micro-batches of each rank, as ModelGroup.train splits one step's batch."""
    return micro_batches_per_rank(exp, RANKS, train_batch_size=BATCH, micro_batch_size=MICRO, epochs=1,
                                  generator=torch.Generator().manual_seed(step))


def _loss(model, exp: Experience) -> torch.Tensor:
    """The actor's loss, token-mean over exp's valid tokens, from the public loss functions."""
    log_probs, logits = _log_probs_and_logits(model, exp)
    mask = exp.action_mask
    policy = ppo_policy_loss(log_probs, exp.action_log_probs, exp.advantages, mask, aggregation="token-mean").loss
    kl = compute_kl(log_probs, exp.base_action_log_probs, mask, KL["estimator"])
    return (policy + kl_in_loss(kl, KL["coef"], mask, "token-mean")
            + entropy_bonus(entropy_from_logits(logits), mask, ENTROPY_COEF, "token-mean"))


def _reference(path: Path, steps: list[Experience], max_grad_norm: float,
               how: Reference = Reference()) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The weights after one AdamW step per Experience, and each step's gradient norm before clipping."""
    model = _load(path).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=how.weight_decay)
    norms = []
    for step, exp in enumerate(steps):
        optimizer.zero_grad()
        parts = [batch for rank in _split(exp, step) for batch in rank] if how.micro_batch_mean else [exp]
        (how.grad_scale * sum(_loss(model, part) for part in parts) / len(parts)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if how.clip else math.inf)
        norms.append(float(norm))
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}, norms


def _distance(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
              initial: dict[str, torch.Tensor]) -> float:
    """max over parameters of |weights - expected| / |expected - initial|: 0 for the same update (the
    update's norm taken as at least LR, one element's full Adam step, so that none divides by 0)."""
    return max(float((weights[name] - value).norm() / (value - initial[name]).norm().clamp(min=LR))
               for name, value in expected.items())


def _trained_by_group(path: Path, steps: list[Experience], max_grad_norm: float, out: Path) -> dict[str, torch.Tensor]:
    placement = Placement(use_gpu=False, bundles=RANKS, ranks={"actor": list(range(RANKS))})
    bundles = create_placement_group(placement)
    group = ModelGroup("actor", bundles, placement)
    training = TrainingSpec(
        zero_stage=3, bf16=False, learning_rate=LR, lr_warmup_ratio=0, lr_scheduler="constant",
        weight_decay=WEIGHT_DECAY, max_grad_norm=max_grad_norm, train_batch_size=BATCH,
        micro_train_batch_size=MICRO, loss_aggregation="token-mean", kl=KL, entropy_coef=ENTROPY_COEF,
    )
    ray.get(group.setup(ModelConfig(role="actor", path=str(path), model=ModelSpec(path=str(path), dtype="float32"),
                                    training=training, temperature=TEMPERATURE, optimizer_steps=len(steps))))
    try:
        for step, exp in enumerate(steps):
            assert [len(batches) for batches in _split(exp, step)] == [BATCH // RANKS // MICRO] * RANKS
            ray.get(group.train(exp, train_batch_size=BATCH, micro_batch_size=MICRO, epochs=1,
                                generator=torch.Generator().manual_seed(step)))
        ray.get(group.call("save_pretrained", str(out)))
    finally:
        for worker in group.workers:
            ray.kill(worker)
        remove_placement_group(bundles)
    return {name: p.detach() for name, p in _load(out).named_parameters()}


def test_two_rank_zero3_steps_equal_single_process_adamw(tiny_model, local_ray, tmp_path):
    steps = _steps(tiny_model)
    initial = {name: p.detach() for name, p in _load(tiny_model).named_parameters()}
    _, (first, second) = _reference(tiny_model, steps, math.inf)
    assert first > 4 * second, "the two steps' gradient norms must differ for the clip to act on one only"
    max_grad_norm = math.sqrt(first * second)
    expected, _ = _reference(tiny_model, steps, max_grad_norm)
    for slip, how in SLIPS.items():
        distance = _distance(_reference(tiny_model, steps, max_grad_norm, how)[0], expected, initial)
        assert distance > 5 * TOLERANCE, f"the test would not see {slip!r} ({distance:.2e})"

    trained = _trained_by_group(tiny_model, steps, max_grad_norm, tmp_path / "trained")
    assert trained.keys() == expected.keys()
    distance = _distance(trained, expected, initial)
    assert distance < TOLERANCE, distance
