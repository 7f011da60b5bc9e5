"""The learning signal at the edges: outlier tokens keep a finite loss and gradient, token-mean weighs
every token of an optimizer step the same across micro-batches and ranks, Dr. GRPO's aggregation is
dr-grpo's default and matches TRL's, rollout correction weighs tokens as its formula says,
rollouts are scored with dropout off, and an offloaded optimizer (torch's AdamW, as on GPUs) steps."""

from __future__ import annotations

import json
import os
import shutil
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
import yaml

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
from rlhf_api.validation import validate
from rlhf_trainer.algorithms import compute_kl, kl_in_loss
from rlhf_trainer.algorithms.kl import KL_BOUND, LOG_RATIO_BOUND
from rlhf_trainer.experience import Experience
from rlhf_trainer.losses import aggregate_loss, ppo_policy_loss
from rlhf_trainer.workers.engine import Model, ModelConfig
from rlhf_trainer.workers.group import micro_batches_per_rank
from rlhf_trainer.workers.objectives import policy_step

TOY_JOB = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-grpo-cpu-job.yaml"

# ---------------------------------------------------------------------------------------------
# clamps: an outlier token (log-ratio 30, or 100: exp overflows float32)
# ---------------------------------------------------------------------------------------------

OUTLIERS = [30.0, -30.0, 100.0, -100.0]


def _outlier_row(log_ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [1, 3] log-probs whose middle token is `log_ratio` away from the other side; a mask."""
    other = torch.tensor([[-1.0, -2.0, -1.5]])
    log_probs = (other + torch.tensor([[0.0, log_ratio, 0.0]])).requires_grad_(True)
    return log_probs, other, torch.ones(1, 3, dtype=torch.bool)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("log_ratio", OUTLIERS)
def test_kl_of_an_outlier_token_is_clamped_with_finite_gradients(estimator, log_ratio):
    """OpenRLHF's compute_approx_kl clamps every estimate to +-10; verl clamps k3's log-ratio to +-20."""
    log_probs, ref, mask = _outlier_row(log_ratio)
    kl = compute_kl(log_probs, ref, mask, estimator)
    assert torch.isfinite(kl).all() and kl.abs().max() <= KL_BOUND
    kl_in_loss(kl, 0.1, mask).backward()
    assert torch.isfinite(log_probs.grad).all()


@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("log_ratio", OUTLIERS)
def test_ppo_ratio_of_an_outlier_token_is_clamped_with_finite_gradients(advantage, log_ratio):
    """verl clamps the PPO log-ratio to +-20 before exp: the loss stays below |A| e^20."""
    log_probs, old, mask = _outlier_row(log_ratio)
    result = ppo_policy_loss(log_probs, old, torch.full((1, 3), advantage), mask, dual_clip=None)
    assert torch.isfinite(result.loss) and result.loss.abs() <= abs(advantage) * torch.exp(torch.tensor(LOG_RATIO_BOUND))
    assert torch.isfinite(result.approx_kl)
    result.loss.backward()
    assert torch.isfinite(log_probs.grad).all()


# ---------------------------------------------------------------------------------------------
# token-mean over the optimizer step's token count
# ---------------------------------------------------------------------------------------------


def test_token_mean_with_the_step_count_weighs_every_token_of_the_step_the_same():
    """Micro-batches of 2 and 8 valid tokens: each token weighs 1/10, not 1/2 and 1/8 (DAPO's token-mean)."""
    short, long = torch.rand(1, 8, requires_grad=True), torch.rand(1, 8, requires_grad=True)
    short_mask = torch.arange(8) < 2
    long_mask = torch.ones(1, 8, dtype=torch.bool)
    total = aggregate_loss(short, short_mask.expand(1, 8), "token-mean", 10) + aggregate_loss(long, long_mask, "token-mean", 10)
    total.backward()
    torch.testing.assert_close(short.grad, short_mask.float().expand(1, 8) / 10)
    torch.testing.assert_close(long.grad, torch.full((1, 8), 0.1))
    assert total.item() == pytest.approx((short[0, :2].sum() + long.sum()).item() / 10)


def _experience(lengths: list[int], width: int = 8, prompt: int = 3, seed: int = 0) -> Experience:
    """Rows of `prompt` + `width` token ids whose responses have `lengths` valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    sequences = torch.randint(3, 300, (batch, prompt + width), generator=gen)
    return Experience(
        sequences=sequences, attention_mask=torch.ones_like(sequences),
        action_mask=torch.arange(width) < torch.tensor(lengths)[:, None],
        action_log_probs=-torch.rand(batch, width, generator=gen),
        advantages=torch.randn(batch, width, generator=gen),
    )


def test_every_micro_batch_carries_its_step_s_token_count_over_all_ranks():
    experience = _experience([1, 2, 3, 4, 5, 6, 7, 8])
    per_rank = micro_batches_per_rank(experience, 2, train_batch_size=4, micro_batch_size=1, epochs=2,
                                      generator=torch.Generator().manual_seed(0))
    assert [len(batches) for batches in per_rank] == [8, 8]  # 2 epochs * 2 steps * 2 micro-batches per rank
    for step in range(4):
        micro_batches = [b for batches in per_rank for b in batches[2 * step:2 * step + 2]]
        tokens = sum(int(b.action_mask.sum()) for b in micro_batches)
        assert {int(t) for b in micro_batches for t in b.step_tokens} == {tokens}


def _ragged(prompts: list[int], responses: list[int], seed: int = 0) -> Experience:
    """Rows laid out as the trainer lays them out: prompts of `prompts` tokens left-padded, responses of
    `responses` tokens right-padded."""
    gen = torch.Generator().manual_seed(seed)
    width_p, width_r = max(prompts), max(responses)
    sequences = torch.randint(3, 300, (len(prompts), width_p + width_r), generator=gen)
    prompt_mask = torch.arange(width_p) >= width_p - torch.tensor(prompts)[:, None]
    action_mask = torch.arange(width_r) < torch.tensor(responses)[:, None]
    return Experience(sequences=sequences * torch.cat([prompt_mask, action_mask], 1),
                      attention_mask=torch.cat([prompt_mask, action_mask], 1).long(), action_mask=action_mask,
                      action_log_probs=-torch.rand(len(prompts), width_r, generator=gen),
                      advantages=torch.randn(len(prompts), width_r, generator=gen))


def test_micro_batches_hold_rows_of_like_lengths_and_ranks_like_token_counts():
    """A micro-batch packs to its longest row: each rank's rows of an optimizer step come longest first, so
    every micro-batch's shortest row is at least the next one's longest, and the ranks' rows are dealt out
    in turn, their token counts within one row of each other; every row is trained once an epoch."""
    gen = torch.Generator().manual_seed(1)
    prompts, responses = torch.randint(2, 12, (32,), generator=gen).tolist(), torch.randint(1, 16, (32,), generator=gen).tolist()
    experience = _ragged(prompts, responses)
    lengths = experience.attention_mask.sum(-1)
    per_rank = micro_batches_per_rank(experience, 2, train_batch_size=16, micro_batch_size=4, epochs=2,
                                      generator=torch.Generator().manual_seed(0))
    assert [len(batches) for batches in per_rank] == [8, 8]  # 2 epochs * 2 steps * 2 micro-batches a rank
    for batches in per_rank:
        for step in range(4):
            first, second = (b.attention_mask.sum(-1) for b in batches[2 * step:2 * step + 2])
            assert first.min() >= second.max()
    for step in range(4):
        totals = [sum(int(b.attention_mask.sum()) for b in batches[2 * step:2 * step + 2]) for batches in per_rank]
        assert abs(totals[0] - totals[1]) <= int(lengths.max())
    for epoch in range(2):
        trained = sorted(tuple(row.tolist()) for batches in per_rank for b in batches[4 * epoch:4 * epoch + 4]
                         for row in b.sequences)
        assert trained == sorted(tuple(row.tolist()) for row in experience.sequences)


@pytest.fixture(scope="module")
def one_rank():
    """This process as the only rank of a torch.distributed group (what a ModelWorker joins); the
    environment it sets is restored after the module."""
    from rlhf_trainer.workers.distributed import COLLECTIVE_TIMEOUT, init_distributed, open_store

    saved = dict(os.environ)
    init_distributed(0, 1, open_store(1, COLLECTIVE_TIMEOUT), use_gpu=False)
    yield
    torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def _actor_config(path, **training) -> ModelConfig:
    training = TrainingSpec(zero_stage=0, bf16=False, lr_warmup_ratio=0, lr_scheduler="constant", **training)
    return ModelConfig(role="actor", path=str(path), model=ModelSpec(path=str(path), dtype="float32"), training=training)


def _hand_log_probs(model, sequences: torch.Tensor, num_actions: int) -> torch.Tensor:
    logits = model(input_ids=sequences).logits[:, -num_actions - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, -num_actions:, None])[..., 0]


def _assert_same_gradients(grads: dict[str, torch.Tensor], hand) -> None:
    """The engine's gradients (grads, by parameter name) equal the hand-computed ones of `hand`. The
    float32 sums run in another order (batches of 1 against one of 2), so the noise scales with each
    gradient's size and so does the tolerance; a wrong formula is off by a factor (2, 5, 16)."""
    for name, param in hand.named_parameters():
        scale = float(param.grad.abs().max())
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


# The step's loss from the per-token losses [2 sequences, 8] (rows of 2 and 8 valid tokens), by hand.
STEP_LOSS_BY_HAND = {
    "token-mean": lambda loss, mask: loss[mask].sum() / 10,
    "seq-mean-token-mean": lambda loss, mask: sum(row[m].mean() for row, m in zip(loss, mask)) / 2,
    "seq-mean-token-sum": lambda loss, mask: sum(row[m].sum() for row, m in zip(loss, mask)) / 2,
    "seq-mean-token-sum-norm": lambda loss, mask: sum(row[m].sum() for row, m in zip(loss, mask)) / 2 / 16,
}


@pytest.mark.parametrize("aggregation", list(STEP_LOSS_BY_HAND))
def test_policy_step_aggregates_the_step_as_its_formula_says(tiny_model, one_rank, aggregation):
    """The real policy step on a tiny model in a DeepSpeed engine, 2 micro-batches of 2 and 8 valid
    tokens accumulated into one optimizer step: its gradient is that of the aggregation's formula over
    the whole step (for token-mean: the 10 token losses over 10), DeepSpeed's division by the
    accumulation steps accounted for; seq-mean-token-sum-norm's budget is rollout.maxNewTokens (16)."""
    from transformers import AutoModelForCausalLM

    hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    experience = _experience([2, 8])
    experience.action_log_probs = _hand_log_probs(hand, experience.sequences, 8).detach()  # ratio 1: no clipping
    ratio = (_hand_log_probs(hand, experience.sequences, 8) - experience.action_log_probs).exp()
    STEP_LOSS_BY_HAND[aggregation](-(experience.advantages * ratio), experience.action_mask).backward()

    grads, _ = _one_policy_step(tiny_model, experience, loss_aggregation=aggregation)
    _assert_same_gradients(grads, hand)


def _one_policy_step(tiny_model, experience: Experience, **training) -> tuple[dict, list[dict]]:
    """The real policy step in a DeepSpeed engine on `experience` (2 samples, one per micro-batch, one
    optimizer step): the gradients the optimizer steps with, by parameter name, and each micro-batch's
    metrics."""
    from rlhf_trainer.workers.engine import load_model

    config = _actor_config(tiny_model, train_batch_size=2, micro_train_batch_size=1, max_grad_norm=1e9, **training)
    model = load_model(replace(config, max_new_tokens=16), 0, 1)
    grads = {}
    model.engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.update(
        {name: p.grad.clone() for name, p in model.engine.module.named_parameters()}))
    [micro_batches] = micro_batches_per_rank(experience, 1, train_batch_size=2, micro_batch_size=1, epochs=1,
                                             generator=torch.Generator().manual_seed(0))
    metrics = [policy_step(model, batch) for batch in micro_batches]
    assert grads, "the two micro-batches must make one optimizer step"
    return grads, metrics


@pytest.mark.parametrize("cap", [None, 2.0], ids=["off-by-default", "cap-2"])
def test_rollout_correction_weighs_each_token_by_its_truncated_engine_ratio(tiny_model, one_rank, cap):
    """Engine log-probs perturbed by hand from the trainer's (their gap d from -1 to 1.5 over the 16
    tokens): with training.rolloutCorrectionCap C the step's gradient is that of the token-mean of
    -A * min(e^d, C) * ratio (Yao et al. 2025), the tokens with e^d > C counted as clipped; unset,
    the same perturbed batch trains exactly as plain PPO-clip."""
    from transformers import AutoModelForCausalLM

    hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    experience = _experience([2, 8])
    experience.action_log_probs = _hand_log_probs(hand, experience.sequences, 8).detach()
    gap = torch.linspace(-1.0, 1.5, 16).view(2, 8)  # trainer's old log-prob minus the engine's
    experience.rollout_log_probs = experience.action_log_probs - gap
    weights = torch.ones(2, 8) if cap is None else gap.exp().clamp(max=cap)
    ratio = (_hand_log_probs(hand, experience.sequences, 8) - experience.action_log_probs).exp()
    STEP_LOSS_BY_HAND["token-mean"](-(experience.advantages * weights * ratio), experience.action_mask).backward()

    grads, metrics = _one_policy_step(tiny_model, experience, rollout_correction_cap=cap)
    _assert_same_gradients(grads, hand)
    clipped = [m.get("rollout_correction_clipped_fraction") for m in metrics]
    if cap is None:
        assert clipped == [None, None]
    else:  # row 0's 2 valid gaps -1, -0.83: none above ln 2; row 1's 0.33 .. 1.5: 0.83, 1.0, 1.17, 1.33, 1.5
        assert sorted(clipped) == [0.0, 5 / 8]


def test_a_step_without_old_log_probs_trains_as_with_the_actors_own_and_reports_their_metrics(tiny_model, one_rank):
    """One optimizer step per rollout (trainer.actor_scored_in_update): the experience carries no
    action_log_probs, the step reads its own forward's, detached. Same gradient as with the actor's
    log-probs scored before the update (ratio 1, rollout correction and the KL in the loss included),
    and the metrics the trainer would have computed from them (logprob_diff, kl) come from the step."""
    from transformers import AutoModelForCausalLM

    hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    scored = _experience([2, 8])
    scored.action_log_probs = _hand_log_probs(hand, scored.sequences, 8).detach()
    gap = torch.linspace(-1.0, 1.5, 16).view(2, 8)
    scored.rollout_log_probs = scored.action_log_probs - gap
    scored.base_action_log_probs = scored.action_log_probs + 0.3 * gap
    training = dict(rollout_correction_cap=2.0, kl={"coef": 0.1, "placement": "loss", "estimator": "k3"})
    with_scores, with_metrics = _one_policy_step(tiny_model, scored, **training)
    without, metrics = _one_policy_step(tiny_model, replace(scored, action_log_probs=None), **training)
    for name, grad in with_scores.items():
        torch.testing.assert_close(without[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all("logprob_diff" not in m and "kl" not in m for m in with_metrics)
    mask = scored.action_mask  # one row per micro-batch, in a shuffled order: compared as sorted lists
    kl = compute_kl(scored.action_log_probs, scored.base_action_log_probs, mask, "k3")
    assert sorted(m["logprob_diff"] for m in metrics) == pytest.approx(
        sorted(float(gap[row][mask[row]].abs().mean()) for row in range(2)), abs=1e-4)
    assert sorted(m["kl"] for m in metrics) == pytest.approx(
        sorted(float(kl[row][mask[row]].mean()) for row in range(2)), abs=1e-4)


def test_a_zero0_rank_alone_steps_without_copying_its_gradients_to_all_reduce_them(tiny_model, one_rank):
    """One rank has nothing to all-reduce: its optimizer step flattens no gradient into DeepSpeed's reduce
    buffer (a copy the size of the model's gradients), and trains on the loss's gradient all the same
    (test_policy_step_aggregates_the_step_as_its_formula_says)."""
    from rlhf_trainer.workers.engine import load_model

    model = load_model(_actor_config(tiny_model, train_batch_size=2, micro_train_batch_size=1), 0, 1)
    flattened, flatten = [], model.engine.flatten
    model.engine.flatten = lambda tensors: flattened.append(len(tensors)) or flatten(tensors)
    for batch in _experience([2, 8]).split(1):
        policy_step(model, replace(batch, step_tokens=torch.tensor([10.0])))
    assert len(model.grad_norms) == 1 and flattened == []


def test_sft_step_gives_every_token_of_the_step_the_weight_one_over_its_count(tiny_model, one_rank):
    """The offline side of the same rule: two accumulated sft micro-batches of 2 and 8 response
    tokens train as the mean NLL of the step's 10 tokens, not as the mean of two per-batch means."""
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.offline_data import OfflineExample, pack, with_step_tokens
    from rlhf_trainer.workers.engine import load_model
    from rlhf_trainer.workers.objectives import sft_step

    gen = torch.Generator().manual_seed(1)
    examples = [OfflineExample(torch.randint(3, 300, (3,), generator=gen).tolist(),
                               (torch.randint(3, 300, (n,), generator=gen).tolist(),)) for n in (2, 8)]
    batches = [with_step_tokens(pack([example], pad_token_id=0), torch.tensor(10.0)) for example in examples]
    hand = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    (-sum(_hand_log_probs(hand, b.sequences, b.num_actions).sum() for b in batches) / 10).backward()

    model = load_model(_actor_config(tiny_model, train_batch_size=2, micro_train_batch_size=1, max_grad_norm=1e9), 0, 1)
    grads = {}
    model.engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.update(
        {name: p.grad.clone() for name, p in model.engine.module.named_parameters()}))
    for batch in batches:
        sft_step(model, batch)
    assert grads, "the two micro-batches must make one optimizer step"
    _assert_same_gradients(grads, hand)


# ---------------------------------------------------------------------------------------------
# scoring in eval mode
# ---------------------------------------------------------------------------------------------


def test_scoring_twice_with_dropout_gives_the_same_log_probs(tiny_model, one_rank, tmp_path):
    """The old and reference log-probs of ModelWorker.forward come with dropout off; training mode is back after."""
    from rlhf_trainer.workers.model_worker import ModelWorker

    path = shutil.copytree(tiny_model, tmp_path / "dropout")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    worker = ModelWorker(0, 1)
    worker.setup(_actor_config(path, train_batch_size=2, micro_train_batch_size=1, micro_rollout_batch_size=2),
                 *worker.open_rendezvous())
    experience = _experience([8, 5, 3])
    args = experience.sequences, experience.attention_mask, experience.num_actions
    with torch.no_grad():
        assert not torch.equal(worker.model.action_log_probs(*args), worker.model.action_log_probs(*args)), \
            "dropout must be active in training mode for this test to mean anything"
    torch.testing.assert_close(worker.forward(*args), worker.forward(*args), rtol=0, atol=0)
    assert worker.model.engine.module.training


def test_scoring_runs_micro_batches_of_like_lengths_and_returns_rows_in_their_order(tiny_model, one_rank):
    """ModelWorker.forward scores rows longest first (a micro-batch packs to its longest row) and hands back
    each row's log-probs where the row was: each equal to the row scored alone."""
    from rlhf_trainer.workers.model_worker import ModelWorker

    worker = ModelWorker(0, 1)
    worker.setup(_actor_config(tiny_model, train_batch_size=2, micro_train_batch_size=1, micro_rollout_batch_size=2),
                 *worker.open_rendezvous())
    experience = _ragged([3, 9, 5, 7, 2], [2, 5, 1, 8, 4])  # rows of 5, 14, 6, 15 and 6 tokens
    args = experience.sequences, experience.attention_mask, experience.num_actions
    seen = []
    read = worker.model.action_log_probs
    worker.model.action_log_probs = lambda sequences, attention_mask, num_actions: (
        seen.append(attention_mask.sum(-1).tolist()) or read(sequences, attention_mask, num_actions))
    log_probs = worker.forward(*args)
    assert seen == [[15, 14], [6, 6], [5]]
    with torch.no_grad(), worker.model.scoring():
        alone = torch.cat([read(*(t[row:row + 1] for t in args[:2]), args[2]) for row in range(5)])
    mask = experience.action_mask
    torch.testing.assert_close(log_probs[mask], alone[mask])


# ---------------------------------------------------------------------------------------------
# Dr. GRPO: dr-grpo's default aggregation, on the production path, against TRL's dr_grpo
# ---------------------------------------------------------------------------------------------


@dataclass
class LogitsModel:
    """A rank's Model whose forward pass returns given logits; backward_step backpropagates."""

    cfg: ModelConfig
    logits: torch.Tensor
    losses: list = field(default_factory=list)

    sequence_parallel = None  # whole rows: Model.action_reads reads action_logits
    action_reads = Model.action_reads

    def action_logits(self, sequences, attention_mask, num_actions, vision=None):
        return self.logits

    def backward_step(self, loss):
        self.losses.append(loss.detach())
        loss.backward()


def _dr_grpo_job(max_new_tokens: int, beta: float, eps_high: float):
    manifest = yaml.safe_load(TOY_JOB.read_text())
    spec = manifest["spec"]
    spec["algorithm"] = "dr-grpo"
    spec["rollout"]["maxNewTokens"] = max_new_tokens
    spec["training"].update(kl={"coef": beta, "estimator": "k3", "placement": "loss"}, clipEpsHigh=eps_high)
    return validate(manifest).spec


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 16)])
@pytest.mark.parametrize("beta,eps_high", [(0.0, 0.2), (0.04, 0.28)])
def test_dr_grpo_policy_step_matches_trl_dr_grpo(shape, beta, eps_high, trl_trainer):
    """The dr-grpo job's policy step, aggregation and budget from the catalogue and the rollout spec
    (as Trainer passes them), against TRL 1.16's GRPOTrainer._compute_loss with loss_type dr_grpo:
    sum of token losses / (batch * max_completion_length)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    b, t = shape
    max_len = t + 5
    spec = _dr_grpo_job(max_len, beta, eps_high)
    assert spec.training.loss_aggregation == "seq-mean-token-sum-norm"
    gen = torch.Generator().manual_seed(b * 31 + t)
    logits = 2 * torch.randn(b, t, 11, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (b, t), generator=gen)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t) < lengths[:, None]
    log_probs = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    old = log_probs + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    ref = log_probs + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)

    ours = LogitsModel(ModelConfig(role="actor", path="unused", model=spec.models.actor, training=spec.training,
                                   max_new_tokens=spec.rollout.max_new_tokens), logits.clone().requires_grad_(True))
    sequences = torch.cat([torch.ones(b, 2, dtype=torch.long), labels], dim=1)
    policy_step(ours, Experience(
        sequences=sequences, attention_mask=torch.ones_like(sequences), action_mask=mask, action_log_probs=old,
        base_action_log_probs=ref, advantages=adv[:, None].expand(b, t).clone()))

    trl_logits = logits.clone().requires_grad_(True)
    trl_log_probs = torch.log_softmax(trl_logits, -1).gather(-1, labels[..., None])[..., 0]
    trainer = trl_trainer(
        GRPOTrainer,
        _get_per_token_logps_and_entropies=lambda *a, **k: (trl_log_probs, torch.zeros(b, t), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type="dr_grpo", epsilon_low=0.2, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=max_len, _entropy_bonus_enabled=False, use_adaptive_entropy=False, entropy_coef=0.0,
    )
    trl_loss = trainer._compute_loss(None, {
        "prompt_ids": sequences[:, :2], "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": labels, "completion_mask": mask.long(), "advantages": adv,
        "old_per_token_logps": old, "ref_per_token_logps": ref, "num_items_in_batch": mask.sum().double(),
    })
    trl_loss.backward()

    [loss] = ours.losses
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-9)
    torch.testing.assert_close(ours.logits.grad, trl_logits.grad, atol=1e-9, rtol=0)


def test_an_offloaded_optimizer_trains_on_cpu(tiny_model, one_rank):
    """ZeRO-Offload with torch's AdamW on the CPU partitions (DeepSpeed refuses a client optimizer there
    unless told, not one its config names): one step moves the weights."""
    from rlhf_trainer.workers.engine import load_model

    training = TrainingSpec(zero_stage=2, offload_optimizer=True, bf16=False, lr_warmup_ratio=0,
                            lr_scheduler="constant", train_batch_size=1, micro_train_batch_size=1)
    model = load_model(ModelConfig(role="actor", path=str(tiny_model), training=training,
                                   model=ModelSpec(path=str(tiny_model), dtype="float32")), 0, 1)
    assert type(model.engine.basic_optimizer) is torch.optim.AdamW and model.engine.basic_optimizer.defaults["fused"]
    before = [p.detach().clone() for p in model.engine.module.parameters()]
    loss = model.engine(input_ids=torch.arange(8)[None]).logits.float().square().mean()
    model.engine.backward(loss)
    model.engine.step()
    assert any(not torch.equal(p, q) for p, q in zip(before, model.engine.module.parameters()))


# ---------------------------------------------------------------------------------------------
# bfloat16: autocast on float32 weights, or bfloat16 weights
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, updates_land", [("float32", True), ("bfloat16", False)],
                         ids=["autocast-on-float32-weights", "bfloat16-weights"])
def test_bf16_computes_in_bfloat16_and_keeps_small_updates_only_on_float32_weights(tiny_model, one_rank, dtype,
                                                                                    updates_land):
    """training.bf16: the passes' matmuls run in bfloat16 either way. On float32 weights (torch autocast) an
    update far below bfloat16's grid (Adam's first step moves each weight by about the learning rate, 1e-7;
    a weight of 0.02 has neighbours 8e-5 away in bfloat16) lands in the weights the next pass reads; on
    bfloat16 weights DeepSpeed's float32 master copy takes it, but the copy the passes read moves only once
    the updates add up to its grid: why ten steps of lr 1e-5 barely moved SmolLM2 in bfloat16 weights
    (benchmarks/README.md)."""
    from rlhf_trainer.workers.engine import load_model

    training = TrainingSpec(zero_stage=2, bf16=True, learning_rate=1e-7, weight_decay=0.0, lr_warmup_ratio=0,
                            lr_scheduler="constant", train_batch_size=1, micro_train_batch_size=1, max_grad_norm=1e9)
    model = load_model(ModelConfig(role="actor", path=str(tiny_model), training=training,
                                   model=ModelSpec(path=str(tiny_model), dtype=dtype)), 0, 1)
    projection = model.engine.module.model.layers[0].mlp.up_proj
    outputs = []
    hook = projection.register_forward_hook(lambda module, args, output: outputs.append(output.dtype))
    before = projection.weight.detach().clone()
    loss = model.engine(input_ids=torch.arange(3, 19)[None]).logits.float().square().mean()
    model.engine.backward(loss)
    model.engine.step()
    hook.remove()
    assert outputs == [torch.bfloat16]
    assert projection.weight.dtype == getattr(torch, dtype)
    moved = (projection.weight.detach() != before).float().mean().item()
    assert (moved > 0.9) if updates_land else (moved < 0.01), moved
