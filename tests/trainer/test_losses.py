"""Online losses, aggregation and SFT/RM losses against plain-loop references (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import TrainingSpec
from rlhf_trainer.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    pairwise_reward_loss,
    policy_loss,
    ppo_policy_loss,
    reward_accuracy,
    sft_loss,
    token_log_probs,
    top_k_divergence,
    truncated_is_weights,
    value_loss,
)

ATOL = 1e-6
SHAPES = [(1, 1), (3, 7), (8, 16), (2, 65)]
AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def make_mask(b: int, t: int, gen: torch.Generator) -> tuple[torch.Tensor, list[int]]:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    return torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1), lengths.tolist()


def ref_aggregate(table: list[list[float]], lengths: list[int], mode: str, normalizer=None) -> float:
    """table[b][t] per-token values; only t < lengths[b] count."""
    rows = [row[:length] for row, length in zip(table, lengths)]
    if mode == "token-mean":
        flat = [v for row in rows for v in row]
        return sum(flat) / len(flat)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in rows) / len(rows)
    budget = len(table[0]) if normalizer is None else normalizer
    return sum(sum(row) for row in rows) / len(rows) / budget


# ---------------------------------------------------------------------------------------------
# aggregation and masked helpers
# ---------------------------------------------------------------------------------------------


def test_aggregation_registry_keys_and_unknown_name():
    assert sorted(LOSS_AGGREGATIONS) == sorted(AGGS)
    with pytest.raises(KeyError) as err:
        aggregate_loss(torch.ones(1, 1), torch.ones(1, 1), "seq-sum")
    for name in AGGS:
        assert name in str(err.value)


@pytest.mark.parametrize("mode", AGGS)
@pytest.mark.parametrize("shape", SHAPES)
def test_aggregation_matches_reference(mode, shape):
    gen = torch.Generator().manual_seed(shape[1])
    loss = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask, lengths = make_mask(*shape, gen)
    got = aggregate_loss(loss, mask, mode)
    assert abs(got.item() - ref_aggregate(loss.tolist(), lengths, mode)) < ATOL
    if mode == "seq-mean-token-sum-norm":
        got = aggregate_loss(loss, mask, mode, normalizer=100)
        assert abs(got.item() - ref_aggregate(loss.tolist(), lengths, mode, 100)) < ATOL


def test_sequence_modes_differ_from_token_mean_on_ragged_masks():
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(9 / 5)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(4.5)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 9).item() == pytest.approx(0.5)


def test_masked_helpers_match_reference_and_ignore_padding_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    mask, lengths = make_mask(5, 9, gen)
    x_poisoned = torch.where(mask, x, torch.full_like(x, 1e6))
    flat = [x[b, t].item() for b, length in enumerate(lengths) for t in range(length)]
    mean = sum(flat) / len(flat)
    for unbiased in (False, True):
        var = sum((v - mean) ** 2 for v in flat) / (len(flat) - (1 if unbiased else 0))
        assert abs(masked_var(x_poisoned, mask, unbiased).item() - var) < ATOL
        white = masked_whiten(x_poisoned, mask, eps=1e-8, unbiased=unbiased)
        for b, length in enumerate(lengths):
            for t in range(9):
                want = (x[b, t].item() - mean) / math.sqrt(var + 1e-8) if t < length else 0.0
                assert abs(white[b, t].item() - want) < ATOL
    assert abs(masked_mean(x_poisoned, mask).item() - mean) < ATOL
    row_means = masked_mean(x_poisoned, mask, dim=-1)
    for b, length in enumerate(lengths):
        assert abs(row_means[b].item() - sum(x[b, :length].tolist()) / length) < ATOL
    assert masked_mean(x, torch.zeros_like(mask), dim=-1).abs().max() == 0  # empty rows: 0, not NaN


# ---------------------------------------------------------------------------------------------
# PPO policy loss
# ---------------------------------------------------------------------------------------------


def ref_ppo_token(lp, old, adv, eps_low, eps_high, dual):
    ratio = math.exp(lp - old)
    surr1 = ratio * adv
    surr2 = min(max(ratio, 1 - eps_low), 1 + eps_high) * adv
    objective = min(surr1, surr2)
    dual_active = False
    if dual is not None and adv < 0 and dual * adv > objective:
        objective, dual_active = dual * adv, True
    return -objective, surr2 < surr1, dual_active


def make_policy_batch(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(*shape, generator=gen, dtype=torch.float64) * 3
    new = old + 0.8 * torch.randn(*shape, generator=gen, dtype=torch.float64)  # ratios far outside the clip
    adv = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask, lengths = make_mask(*shape, gen)
    return new, old, adv, mask, lengths


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGGS)
@pytest.mark.parametrize(
    "eps_low,eps_high,dual", [(0.2, None, None), (0.2, 0.28, None), (0.1, None, 2.0), (0.2, 0.3, 1.5)]
)
def test_ppo_loss_matches_reference(shape, mode, eps_low, eps_high, dual):
    new, old, adv, mask, lengths = make_policy_batch(shape, seed=shape[0] * 100 + shape[1])
    out = ppo_policy_loss(new, old, adv, mask, eps_low, eps_high, dual, aggregation=mode)
    table, clipped, duals, kls = [], [], [], []
    for b in range(shape[0]):
        row = []
        for t in range(shape[1]):
            loss, c, d = ref_ppo_token(
                new[b, t].item(), old[b, t].item(), adv[b, t].item(),
                eps_low, eps_low if eps_high is None else eps_high, dual,
            )
            row.append(loss)
            if t < lengths[b]:
                clipped.append(c)
                duals.append(d)
                r = math.exp(new[b, t].item() - old[b, t].item())
                kls.append(r - 1 - math.log(r))
        table.append(row)
    assert abs(out.loss.item() - ref_aggregate(table, lengths, mode)) < ATOL
    assert abs(out.clip_fraction.item() - sum(clipped) / len(clipped)) < ATOL
    assert abs(out.dual_clip_fraction.item() - sum(duals) / len(duals)) < ATOL
    assert abs(out.approx_kl.item() - sum(kls) / len(kls)) < ATOL
    if dual is not None and shape[1] > 10:
        assert out.dual_clip_fraction.item() > 0, "the inputs must exercise the dual clip"


def test_ppo_gradient_flows_only_through_unclipped_tokens():
    new = torch.tensor([[0.5, 0.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    ppo_policy_loss(new, old, adv, mask, 0.2).loss.backward()
    # token 0: ratio e^0.5 > 1.2 with A > 0 -> clipped, zero gradient; token 1: ratio 1 -> -A/3
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-1 / 3)
    assert new.grad[0, 2].item() == pytest.approx(-math.exp(-0.5) / 3)


def test_ppo_refuses_dual_clip_not_above_one():
    new, old, adv, mask, _ = make_policy_batch((2, 3), seed=0)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(new, old, adv, mask, dual_clip=1.0)


def test_policy_metrics_are_plain_floats():
    new, old, adv, mask, _ = make_policy_batch((2, 3), seed=0)
    metrics = ppo_policy_loss(new, old, adv, mask).metrics()
    assert set(metrics) == {"loss", "clip_fraction", "dual_clip_fraction", "approx_kl"}
    assert all(isinstance(v, float) for v in metrics.values())


def test_rollout_correction_weights_are_the_engine_ratio_truncated_at_the_cap():
    """Yao et al. 2025's TIS weight min(pi_old / pi_engine, C), C = 2: engine log-probs 1, 0, -0.5,
    -1 and -3 away from the trainer's give e^-1, 1, e^0.5, 2 (e^1 capped) and a masked 2 (e^3 capped);
    one of the four valid tokens is clipped."""
    old = torch.full((1, 5), -1.0)
    engine = old - torch.tensor([[-1.0, 0.0, 0.5, 1.0, 3.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    out = truncated_is_weights(old, engine, mask, cap=2.0)
    torch.testing.assert_close(out.weights, torch.tensor([[0.367879, 1.0, 1.648721, 2.0, 2.0]]))
    assert out.clipped_fraction.item() == 0.25
    assert truncated_is_weights(old, torch.full((1, 5), -math.inf), mask, cap=2.0).weights.eq(2.0).all()


# ---------------------------------------------------------------------------------------------
# value loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("clip", [None, 0.2, 0.5])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_reference(shape, clip, mode):
    gen = torch.Generator().manual_seed(sum(shape))
    old = torch.randn(*shape, generator=gen, dtype=torch.float64)
    values = old + 0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)
    returns = torch.randn(*shape, generator=gen, dtype=torch.float64)
    mask, lengths = make_mask(*shape, gen)
    out = value_loss(values, old, returns, mask, clip, aggregation=mode)
    table, clipped = [], []
    for b in range(shape[0]):
        row = []
        for t in range(shape[1]):
            v, o, r = values[b, t].item(), old[b, t].item(), returns[b, t].item()
            err = (v - r) ** 2
            if clip is None:
                row.append(0.5 * err)
                is_clipped = False
            else:
                vc = o + min(max(v - o, -clip), clip)
                err_c = (vc - r) ** 2
                row.append(0.5 * max(err, err_c))
                is_clipped = err_c > err
            if t < lengths[b]:
                clipped.append(is_clipped)
        table.append(row)
    assert abs(out.loss.item() - ref_aggregate(table, lengths, mode)) < ATOL
    assert abs(out.clip_fraction.item() - sum(clipped) / len(clipped)) < ATOL


# ---------------------------------------------------------------------------------------------
# entropy, SFT, reward model
# ---------------------------------------------------------------------------------------------


def ref_log_softmax(row: list[float]) -> list[float]:
    m = max(row)
    lse = m + math.log(sum(math.exp(z - m) for z in row))
    return [z - lse for z in row]


@pytest.mark.parametrize("b,t,v", [(1, 1, 2), (3, 5, 11), (2, 8, 64)])
def test_entropy_and_bonus_match_reference(b, t, v):
    gen = torch.Generator().manual_seed(v)
    logits = 3 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    mask, lengths = make_mask(b, t, gen)
    ent = entropy_from_logits(logits)
    table = []
    for i in range(b):
        row = []
        for j in range(t):
            logp = ref_log_softmax(logits[i, j].tolist())
            row.append(-sum(math.exp(lp) * lp for lp in logp))
            assert abs(ent[i, j].item() - row[-1]) < ATOL
        table.append(row)
    bonus = entropy_bonus(ent, mask, coef=0.01)
    assert abs(bonus.item() + 0.01 * ref_aggregate(table, lengths, "token-mean")) < ATOL


def test_entropy_upcasts_half_precision():
    logits = torch.randn(2, 3, 7, dtype=torch.bfloat16)
    assert entropy_from_logits(logits).dtype == torch.float32


@pytest.mark.parametrize("b,t,v", [(1, 1, 2), (3, 5, 11), (4, 9, 50)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_sft_nll_matches_reference(b, t, v, mode):
    gen = torch.Generator().manual_seed(b * t)
    logits = 2 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (b, t), generator=gen)
    mask, lengths = make_mask(b, t, gen)
    logp = token_log_probs(logits, labels)
    table = [
        [-ref_log_softmax(logits[i, j].tolist())[labels[i, j].item()] for j in range(t)] for i in range(b)
    ]
    for i in range(b):
        for j in range(t):
            assert abs(logp[i, j].item() + table[i][j]) < ATOL
    assert abs(sft_loss(logp, mask, mode).item() - ref_aggregate(table, lengths, mode)) < ATOL
    torch.testing.assert_close(
        sft_loss(logp, torch.ones_like(mask)),
        torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels.reshape(-1)),
        atol=ATOL, rtol=0,
    )


@pytest.mark.parametrize("b", [1, 4, 33])
@pytest.mark.parametrize("with_margin", [False, True])
def test_pairwise_reward_loss_matches_reference(b, with_margin):
    gen = torch.Generator().manual_seed(b)
    chosen = 2 * torch.randn(b, generator=gen, dtype=torch.float64)
    rejected = 2 * torch.randn(b, generator=gen, dtype=torch.float64)
    margin = torch.rand(b, generator=gen, dtype=torch.float64) if with_margin else None
    terms = []
    for i in range(b):
        d = chosen[i].item() - rejected[i].item() - (margin[i].item() if with_margin else 0.0)
        terms.append(math.log1p(math.exp(-d)))  # -log sigmoid(d)
    assert abs(pairwise_reward_loss(chosen, rejected, margin).item() - sum(terms) / b) < ATOL
    acc = sum(chosen[i].item() > rejected[i].item() for i in range(b)) / b
    assert abs(reward_accuracy(chosen, rejected).item() - acc) < ATOL


# ---------------------------------------------------------------------------------------------
# TRL as an oracle (trl is a dev-only dependency; these tests skip without it)
#
# TRL 1.16's GRPOTrainer._compute_loss is PPO-clip with clip-higher (epsilon_low/high), an optional
# k3 KL term added per token to the loss (beta), a loss aggregation chosen by loss_type, and an
# entropy bonus (token mean); TRL has no public function for it. We run that real method on a
# trainer object without its __init__ (conftest's trl_trainer), stubbing only the forward pass,
# and compare loss, gradients and metrics:
#   TRL loss_type -> our aggregation: grpo -> seq-mean-token-mean, bnpo -> token-mean,
#   dr_grpo -> seq-mean-token-sum-norm with normalizer = max_completion_length (dr-grpo's default;
#   test_edges.py runs its policy step, the normalizer from rollout.maxNewTokens, against TRL),
#   dapo -> token-mean (its normalizer is the batch's token count on one process).
# TRL has no dual clip and no value loss (no PPO trainer in 1.16): those have the loop references only.
# ---------------------------------------------------------------------------------------------


TRL_AGGREGATION = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
}


@pytest.mark.parametrize("loss_type", sorted(TRL_AGGREGATION))
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 16)])
@pytest.mark.parametrize("beta,eps_high,entropy_coef", [(0.0, 0.2, 0.0), (0.04, 0.28, 0.01)])
def test_policy_kl_entropy_losses_match_trl_grpo(loss_type, shape, beta, eps_high, entropy_coef, trl_trainer):
    import types

    from trl.trainer.grpo_trainer import GRPOTrainer

    from rlhf_trainer.algorithms import compute_kl, kl_in_loss

    b, t = shape
    new, old, adv, mask, _ = make_policy_batch(shape, seed=b * 31 + t)
    gen = torch.Generator().manual_seed(t)
    ref = old + 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    ent = torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    max_len = t + 5
    new_trl = new.clone().requires_grad_(True)
    new_ours = new.clone().requires_grad_(True)

    trainer = trl_trainer(
        GRPOTrainer,
        _get_per_token_logps_and_entropies=lambda *a, **k: (new_trl, ent, None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=eps_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        _entropy_bonus_enabled=entropy_coef > 0,
        use_adaptive_entropy=False,
        entropy_coef=entropy_coef,
    )
    inputs = {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum().to(torch.float64),
    }
    trl_loss = trainer._compute_loss(None, inputs)

    mode = TRL_AGGREGATION[loss_type]
    norm = max_len if loss_type == "dr_grpo" else None
    policy = ppo_policy_loss(new_ours, old, adv, mask, 0.2, eps_high, aggregation=mode, normalizer=norm)
    ours = policy.loss + entropy_bonus(ent, mask, entropy_coef)
    kl = compute_kl(new_ours, ref, mask, estimator="k3")
    if beta:
        ours = ours + kl_in_loss(kl, beta, mask, mode, norm)

    assert abs(ours.item() - trl_loss.item()) < ATOL
    ours.backward()
    trl_loss.backward()
    torch.testing.assert_close(new_ours.grad, new_trl.grad, atol=ATOL, rtol=0)
    metrics = trainer._metrics["train"]
    assert abs(policy.clip_fraction.item() - metrics["clip_ratio/region_mean"][-1]) < ATOL
    if beta:
        assert abs(masked_mean(kl, mask).item() - metrics["kl"][-1]) < ATOL


@pytest.mark.parametrize("b,t,v", [(1, 1, 2), (3, 5, 11), (4, 9, 300)])
def test_entropy_and_log_probs_match_trl_utils(b, t, v):
    pytest.importorskip("trl")
    from trl.trainer.utils import entropy_from_logits as trl_entropy
    from trl.trainer.utils import selective_log_softmax

    gen = torch.Generator().manual_seed(v)
    logits = 4 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (b, t), generator=gen)
    torch.testing.assert_close(entropy_from_logits(logits), trl_entropy(logits), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        token_log_probs(logits, labels), selective_log_softmax(logits, labels), atol=ATOL, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# GSPO (Zheng et al. 2025, arXiv 2507.18071): the sequence ratio, by hand and against TRL's
# importance_sampling_level="sequence" (GRPOTrainer._compute_loss with loss_type grpo)
# ---------------------------------------------------------------------------------------------


def _gspo(log_probs, old, advantages, mask):
    training = TrainingSpec().with_defaults("gspo")
    per_token = POLICY_LOSSES[ALGORITHMS["gspo"].policy_loss](log_probs, old, advantages, mask, training)
    return policy_loss(per_token, log_probs, old, mask, training.loss_aggregation)


def test_gspo_loss_is_the_papers_formula_by_hand():
    """Two responses, clip 3e-4 / 4e-4 and seq-mean-token-mean from the catalogue. Response 1: log
    ratios +0.1, -0.1, so s_1 = exp(0) = 1 and A_1 = 1 gives -1. Response 2 (its third token padding):
    log ratios 0.0003, 0.0009, s_2 = exp(0.0006) = 1.00060018 above 1 + 4e-4, so with A_2 = 2 the
    clipped branch is active: -2 * 1.0004 = -2.0008. Loss (-1 - 2.0008) / 2 = -1.5004. Gradient of
    response 1's tokens: -A_1 * ds_1/dlogp_t / G = -1 * (s_1 / |y_1|) / 2 = -0.25; response 2's: 0 (clipped)."""
    new = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.7, -9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, 0.0], [-0.5003, -0.7009, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]], dtype=torch.float64)
    result = _gspo(new, old, adv, mask)
    assert result.loss.item() == pytest.approx(-1.5004, abs=1e-9)
    assert result.clip_fraction.item() == pytest.approx(0.5)  # response 2's two tokens of four
    result.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (8, 16)])
@pytest.mark.parametrize("scale", [1e-4, 0.5])  # log-ratio noise: mostly inside the tiny clip range, far outside
def test_gspo_matches_trl_sequence_level_importance_sampling(shape, scale, trl_trainer):
    import types

    from trl.trainer.grpo_trainer import GRPOTrainer

    b, t = shape
    gen = torch.Generator().manual_seed(b * 31 + t)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    new = old + scale * torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask, _ = make_mask(b, t, gen)
    new_trl = new.clone().requires_grad_(True)
    new_ours = new.clone().requires_grad_(True)
    training = TrainingSpec().with_defaults("gspo")
    trainer = trl_trainer(
        GRPOTrainer,
        _get_per_token_logps_and_entropies=lambda *a, **k: (new_trl, torch.zeros(b, t), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="sequence", beta=0.0,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type="grpo", epsilon_low=training.clip_eps, epsilon_high=training.clip_eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=t, _entropy_bonus_enabled=False, use_adaptive_entropy=False, entropy_coef=0.0,
    )
    trl_loss = trainer._compute_loss(None, {
        "prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.ones(b, t, dtype=torch.long), "completion_mask": mask.long(), "advantages": adv,
        "old_per_token_logps": old, "num_items_in_batch": mask.sum().to(torch.float64),
    })
    ours = _gspo(new_ours, old, adv[:, None].expand(b, t), mask).loss

    assert abs(ours.item() - trl_loss.item()) < ATOL
    ours.backward()
    trl_loss.backward()
    torch.testing.assert_close(new_ours.grad, new_trl.grad, atol=ATOL, rtol=0)


def test_raft_loss_is_the_likelihood_of_the_kept_samples_alone():
    """nll (raft): -A log pi per token, no ratio or clip: its gradient on a kept token is -1 / its
    count (token-mean), on any other 0, however far the policy moved from the one that sampled."""
    gen = torch.Generator().manual_seed(5)
    log_probs = (-torch.rand(4, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    old = log_probs.detach() - 3.0  # far off-policy: PPO's clip would zero every gradient here
    mask = torch.ones(4, 6, dtype=torch.bool)
    advantages = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64).unsqueeze(1).expand(4, 6)
    training = TrainingSpec()
    per_token = POLICY_LOSSES[ALGORITHMS["raft"].policy_loss](log_probs, old, advantages, mask, training)
    loss = policy_loss(per_token, log_probs, old, mask, "token-mean")
    loss.loss.backward()
    expected = -(advantages / mask.sum())
    torch.testing.assert_close(log_probs.grad, expected, atol=ATOL, rtol=0)
    assert loss.clip_fraction == 0 and loss.dual_clip_fraction == 0


def test_an_online_dpo_update_has_the_gradient_of_dpo_on_each_groups_best_and_worst():
    """online-dpo's estimator (dpo-pairs) and loss (nll, seq-mean-token-sum) against the offline DPO loss
    on the same pairs: the same gradient, token for token (a group that scores alike has no pair)."""
    from rlhf_trainer.algorithms import AdvantageConfig, AdvantageInputs, compute_advantages
    from rlhf_trainer.losses import PreferenceConfig, PreferenceInputs, dpo_loss, masked_sum

    gen = torch.Generator().manual_seed(11)
    mask, _ = make_mask(12, 7, gen)
    log_probs = (-torch.rand(12, 7, generator=gen, dtype=torch.float64)).requires_grad_()
    reference = -torch.rand(12, 7, generator=gen, dtype=torch.float64)
    rewards = torch.tensor([0.2, 0.9, 0.1, 0.5, 0.3, 0.3, 0.3, 0.3, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    online = ALGORITHMS["online-dpo"]
    training = TrainingSpec().with_defaults("online-dpo")
    inputs = AdvantageInputs(rewards, mask, n_samples_per_prompt=4, log_ratio=(log_probs - reference).detach())
    advantages, _ = compute_advantages(online.advantage, inputs, AdvantageConfig(beta=0.3))
    per_token = POLICY_LOSSES[online.policy_loss](log_probs, log_probs.detach(), advantages, mask, training)
    policy_loss(per_token, log_probs, log_probs.detach(), mask, training.loss_aggregation).loss.backward()
    ours, log_probs.grad = log_probs.grad.clone(), None

    chosen, rejected = [1, 8], [2, 9]  # group 2 ties; group 3's first best and first worst
    policy, ref = masked_sum(log_probs, mask, dim=1), masked_sum(reference, mask, dim=1)
    pairs = PreferenceInputs(policy[chosen], policy[rejected], ref[chosen], ref[rejected])
    dpo_loss(pairs, PreferenceConfig(beta=0.3)).losses.mean().backward()
    torch.testing.assert_close(ours, log_probs.grad, atol=1e-12, rtol=0)
    assert ours[[0, 3, 4, 5, 6, 7, 10, 11]].abs().sum() == 0 and ours[chosen].abs().sum() > 0


# -- knowledge distillation (kd) -------------------------------------------------------------------


def test_top_k_forward_kl_is_the_full_kl_with_the_whole_vocabulary_and_zero_on_the_teacher_s_top_k():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    teacher_logps = teacher.log_softmax(-1)
    full = (teacher_logps.exp() * (teacher_logps - student.log_softmax(-1))).sum(-1)
    top = teacher_logps.topk(7, dim=-1)
    assert torch.allclose(top_k_divergence(student, top.values, top.indices), full, atol=1e-6)

    top = teacher_logps.topk(3, dim=-1)  # a student with the teacher's top 3, renormalised, and nothing else
    copied = torch.full_like(student, -1e4).scatter(-1, top.indices, top.values)
    assert top_k_divergence(copied, top.values, top.indices).abs().max() < 1e-5
    assert (top_k_divergence(student, top.values, top.indices) > 0.01).all()


def generalized_jsd(p_teacher: torch.Tensor, p_student: torch.Tensor, beta: float) -> torch.Tensor:
    """GKD's JSD(beta) over whole distributions [..., V], from its definition (0 log 0 = 0)."""
    mixture = beta * p_teacher + (1 - beta) * p_student

    def kl(p, q):
        return torch.where(p > 0, p * (p.log() - q.log()), torch.zeros_like(p)).sum(-1)

    return beta * kl(p_teacher, mixture) + (1 - beta) * kl(p_student, mixture)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_the_generalized_jsd_is_gkd_s_over_the_whole_vocabulary_with_the_teacher_zero_off_its_top_k(beta):
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 3, 11, dtype=torch.float64), torch.randn(2, 3, 11, dtype=torch.float64)
    teacher_logps = teacher.log_softmax(-1)
    for k in (11, 4):  # the whole vocabulary; the top 4, the teacher renormalised over them and 0 elsewhere
        top = teacher_logps.topk(k, dim=-1)
        truncated = torch.zeros_like(teacher).scatter(-1, top.indices, top.values.softmax(-1))
        expected = generalized_jsd(truncated, student.softmax(-1), beta)
        assert torch.allclose(top_k_divergence(student, top.values, top.indices, beta), expected.float(), atol=1e-5)

    top = teacher_logps.topk(4, dim=-1)
    copied = torch.full_like(student, -1e4).scatter(-1, top.indices, top.values)
    assert top_k_divergence(copied, top.values, top.indices, beta).abs().max() < 1e-5
    # a student with no mass on the teacher's k tokens: the reverse KL is infinite, the JSD its maximum, the
    # entropy of the mixture's weights (disjoint distributions)
    elsewhere = torch.zeros_like(student).scatter(-1, top.indices, -1e4)
    disjoint = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert torch.allclose(top_k_divergence(elsewhere, top.values, top.indices, beta),
                          torch.full((2, 3), disjoint), atol=1e-5)


def test_the_divergence_s_beta_must_be_below_one():
    logits = torch.randn(1, 2, 5)
    top = logits.log_softmax(-1).topk(2, dim=-1)
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\)"):
        top_k_divergence(logits, top.values, top.indices, 1.0)
