"""Advantage estimators (and the Experience record carrying them) against plain-loop references and TRL."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainer.algorithms import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    register_advantage,
)

ATOL = 1e-6
NAMES = ["gae", "reinforce++", "reinforce++-baseline", "group-norm", "dr-grpo", "rloo", "best-of-n", "dpo-pairs",
         "reverse-kl"]
GROUPED = ["reinforce++-baseline", "group-norm", "dr-grpo", "rloo", "best-of-n", "dpo-pairs"]


def make_inputs(n_prompts: int, n: int, t: int, seed: int, with_kl: bool = True, allow_empty=False):
    gen = torch.Generator().manual_seed(seed)
    b = n_prompts * n
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0] = t  # one full-width response in every batch
    if allow_empty:
        lengths[1] = 0
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.randn(b, generator=gen, dtype=torch.float64)
    kl = 0.05 * torch.randn(b, t, generator=gen, dtype=torch.float64) * mask if with_kl else None
    values = torch.randn(b, t, generator=gen, dtype=torch.float64)
    log_ratio = 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    teacher_log_ratio = 0.3 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    return AdvantageInputs(rewards, mask, kl, values, n, log_ratio, teacher_log_ratio), lengths.tolist()


# ---------------------------------------------------------------------------------------------
# independent references: python lists and loops only
# ---------------------------------------------------------------------------------------------


def ref_token_rewards(inputs: AdvantageInputs, seq_rewards: list[float], lengths: list[int]):
    t_max = inputs.action_mask.shape[1]
    out = []
    for b, length in enumerate(lengths):
        row = [0.0] * t_max
        for t in range(length):
            row[t] = -(inputs.kl_penalty[b, t].item() if inputs.kl_penalty is not None else 0.0)
        if length > 0:
            row[length - 1] += seq_rewards[b]
        out.append(row)
    return out


def ref_returns(rewards, lengths, gamma):
    out = []
    for row, length in zip(rewards, lengths):
        ret = [0.0] * len(row)
        g = 0.0
        for t in range(length - 1, -1, -1):
            g = row[t] + gamma * g
            ret[t] = g
        out.append(ret)
    return out


def ref_gae(rewards, values, lengths, gamma, lambd):
    advs, rets = [], []
    for b, length in enumerate(lengths):
        adv = [0.0] * len(rewards[b])
        ret = [0.0] * len(rewards[b])
        running = 0.0
        for t in range(length - 1, -1, -1):
            next_v = values[b][t + 1] if t + 1 < length else 0.0
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            running = delta + gamma * lambd * running
            adv[t] = running
            ret[t] = running + values[b][t]
        advs.append(adv)
        rets.append(ret)
    return advs, rets


def ref_whiten(x, lengths, eps, unbiased):
    flat = [x[b][t] for b, length in enumerate(lengths) for t in range(length)]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1 if unbiased else len(flat))
    return [
        [(x[b][t] - mean) / math.sqrt(var + eps) if t < length else 0.0 for t in range(len(x[b]))]
        for b, length in enumerate(lengths)
    ]


def ref_shaped_rewards(name: str, rewards: list[float], n: int, eps: float, unbiased: bool):
    out = []
    for p in range(0, len(rewards), n):
        group = rewards[p : p + n]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1 if unbiased else n))
        for i, r in enumerate(group):
            if name in ("reinforce++-baseline", "dr-grpo"):
                out.append(r - mean)
            elif name == "group-norm":
                out.append((r - mean) / (std + eps))
            elif name == "rloo":
                others = [group[j] for j in range(n) if j != i]
                out.append(r - sum(others) / len(others))
            else:
                out.append(r)
    return out


def ref_best_of_n(rewards, lengths, seq_rewards, n, cfg: AdvantageConfig):
    """1 on every response token of each group's keep_per_prompt best (by summed token reward; the
    first of equals first), if better than the group's worst and at least min_reward."""
    scores = [sum(row) for row in rewards]
    adv = []
    for b, length in enumerate(lengths):
        group = range(b - b % n, b - b % n + n)
        better = sum(1 for j in group if scores[j] > scores[b] or (scores[j] == scores[b] and j < b))
        kept = (better < cfg.keep_per_prompt and scores[b] > min(scores[j] for j in group)
                and (cfg.min_reward is None or seq_rewards[b] >= cfg.min_reward))
        adv.append([1.0 if kept and t < length else 0.0 for t in range(len(rewards[b]))])
    return adv


def ref_dpo_pairs(inputs, rewards, lengths, n, beta):
    """Each group's first best against its first worst; d(mean over pairs of -log sigmoid(beta * margin))
    / d(summed log-ratio) by hand, negated and times the rows, on every response token."""
    scores = [sum(row) for row in rewards]
    ratio = [sum(inputs.log_ratio[b, t].item() for t in range(length)) for b, length in enumerate(lengths)]
    pairs = []
    for start in range(0, len(scores), n):
        group = scores[start:start + n]
        if max(group) > min(group):
            pairs.append((start + group.index(max(group)), start + group.index(min(group))))
    weight = [0.0] * len(scores)
    for chosen, rejected in pairs:
        pull = beta / (1 + math.exp(beta * (ratio[chosen] - ratio[rejected]))) * len(scores) / len(pairs)
        weight[chosen], weight[rejected] = pull, -pull
    return [[weight[b] if t < length else 0.0 for t in range(len(rewards[b]))] for b, length in enumerate(lengths)]


def reference(name: str, inputs: AdvantageInputs, lengths: list[int], cfg: AdvantageConfig):
    seq = ref_shaped_rewards(
        name, inputs.rewards.tolist(), inputs.n_samples_per_prompt, cfg.eps, cfg.unbiased_std
    )
    if name == "reverse-kl":  # the sequence reward weighed, each token's teacher log-ratio subtracted
        seq = [cfg.reward_coef * r for r in seq]
    rewards = ref_token_rewards(inputs, seq, lengths)
    if name == "reverse-kl":
        rewards = [[r - cfg.teacher_coef * inputs.teacher_log_ratio[b, t].item() if t < lengths[b] else r
                    for t, r in enumerate(row)] for b, row in enumerate(rewards)]
    if name == "gae":
        adv, ret = ref_gae(rewards, inputs.values.tolist(), lengths, cfg.gamma, cfg.lambd)
    elif name == "dpo-pairs":
        ret = ref_returns(rewards, lengths, cfg.gamma)
        adv = ref_dpo_pairs(inputs, rewards, lengths, inputs.n_samples_per_prompt, cfg.beta)
    elif name == "best-of-n":
        ret = ref_returns(rewards, lengths, cfg.gamma)
        adv = ref_best_of_n(rewards, lengths, seq, inputs.n_samples_per_prompt, cfg)
    else:
        ret = ref_returns(rewards, lengths, cfg.gamma)
        adv = [list(row) for row in ret]
    default_whiten = name in ("gae", "reinforce++", "reinforce++-baseline")
    if default_whiten if cfg.whiten is None else cfg.whiten:
        adv = ref_whiten(adv, lengths, cfg.eps, cfg.unbiased_std)
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(ret, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------


def test_registry_keys_are_exactly_the_api_names():
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(NAMES)


def test_unknown_estimator_lists_valid_names():
    inputs, _ = make_inputs(1, 2, 3, seed=0)
    with pytest.raises(KeyError) as err:
        compute_advantages("grpo", inputs)
    for name in NAMES:
        assert name in str(err.value)


def test_register_advantage_adds_and_refuses_duplicates():
    @register_advantage("zero-test-only")
    def zero(inputs, cfg):
        return torch.zeros_like(inputs.values), torch.zeros_like(inputs.values)

    try:
        assert ADVANTAGE_ESTIMATORS["zero-test-only"] is zero
        with pytest.raises(ValueError):
            register_advantage("gae")(zero)
    finally:
        del ADVANTAGE_ESTIMATORS["zero-test-only"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "n_prompts,n,t,seed", [(1, 2, 1, 0), (3, 4, 7, 1), (4, 2, 16, 2), (2, 8, 33, 3)]
)
@pytest.mark.parametrize(
    "cfg",
    [
        AdvantageConfig(),
        AdvantageConfig(gamma=0.9, lambd=0.8, whiten=True, unbiased_std=False, eps=1e-6),
        AdvantageConfig(gamma=0.99, lambd=1.0, whiten=False),
        AdvantageConfig(gamma=0.9, teacher_coef=0.5, reward_coef=2.0),
    ],
    ids=["defaults", "discounted-whitened-population", "no-whiten", "distill-weights"],
)
def test_estimator_matches_loop_reference(name, n_prompts, n, t, seed, cfg):
    inputs, lengths = make_inputs(n_prompts, n, t, seed)
    if sum(lengths) < 2 and (cfg.whiten or cfg.whiten is None):
        pytest.skip("whitening needs two tokens")
    adv, ret = compute_advantages(name, inputs, cfg)
    ref_adv, ref_ret = reference(name, inputs, lengths, cfg)
    assert adv.shape == ret.shape == inputs.action_mask.shape
    torch.testing.assert_close(adv, ref_adv, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_without_kl_penalty_and_with_empty_responses(name):
    inputs, lengths = make_inputs(3, 4, 9, seed=7, with_kl=False, allow_empty=True)
    assert 0 in lengths, "the case needs an empty response"
    cfg = AdvantageConfig(gamma=0.95)
    adv, ret = compute_advantages(name, inputs, cfg)
    ref_adv, ref_ret = reference(name, inputs, lengths, cfg)
    torch.testing.assert_close(adv, ref_adv, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=ATOL, rtol=0)
    assert torch.all(adv[~inputs.action_mask] == 0) and torch.all(ret[~inputs.action_mask] == 0)


def test_group_norm_gives_unit_scale_groups_and_zero_for_constant_groups():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv, _ = compute_advantages("group-norm", AdvantageInputs(rewards, mask, n_samples_per_prompt=2))
    # group 1: mean 2, Bessel std sqrt(2); group 2: all equal -> 0
    expected = torch.tensor([[-1 / math.sqrt(2)], [1 / math.sqrt(2)], [0.0], [0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("keep, min_reward", [(1, None), (2, None), (2, 0.0), (3, 10.0)])
def test_best_of_n_keeps_each_groups_best_against_the_reference(keep, min_reward):
    inputs, lengths = make_inputs(4, 4, 9, seed=13, allow_empty=True)
    cfg = AdvantageConfig(gamma=0.9, keep_per_prompt=keep, min_reward=min_reward)
    adv, ret = compute_advantages("best-of-n", inputs, cfg)
    ref_adv, ref_ret = reference("best-of-n", inputs, lengths, cfg)
    torch.testing.assert_close(adv, ref_adv, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=ATOL, rtol=0)
    kept = adv.any(dim=1).reshape(4, 4).sum(dim=1)
    assert kept.max() <= keep and (kept.sum() > 0) == (min_reward is None or min_reward < 1)


def test_best_of_n_keeps_the_first_of_equals_and_nothing_of_a_group_that_scores_alike():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    mask = torch.ones(8, 2, dtype=torch.bool)
    adv, _ = compute_advantages("best-of-n", AdvantageInputs(rewards, mask, n_samples_per_prompt=4))
    assert adv[:, 0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0] and torch.equal(adv[:, 0], adv[:, 1])
    # With a KL penalty in the reward, the sample that drifted less wins the tie.
    kl = torch.zeros(8, 2, dtype=torch.float64)
    kl[1, 0] = 0.1
    adv, _ = compute_advantages("best-of-n", AdvantageInputs(rewards, mask, kl, n_samples_per_prompt=4))
    assert adv[:, 0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]


def test_reverse_kl_favours_the_tokens_the_teacher_finds_likelier_and_ignores_the_reward_by_default():
    mask = torch.ones(1, 2, dtype=torch.bool)
    inputs = AdvantageInputs(torch.tensor([5.0], dtype=torch.float64), mask,
                             teacher_log_ratio=torch.tensor([[-1.0, 1.0]], dtype=torch.float64))
    adv, _ = compute_advantages("reverse-kl", inputs, AdvantageConfig(gamma=0.0))
    assert adv.tolist() == [[1.0, -1.0]]  # the teacher likelier: up; the actor likelier: down
    adv, _ = compute_advantages("reverse-kl", inputs, AdvantageConfig(gamma=0.0, reward_coef=0.1))
    assert adv.tolist() == [[1.0, -0.5]]  # the reward, weighed, on the last token
    # the teacher's weight 0 (its divergence in the loss: jsdBeta): the reward alone, no log-ratio needed
    without_teacher = AdvantageInputs(inputs.rewards, mask)
    adv, _ = compute_advantages("reverse-kl", without_teacher, AdvantageConfig(gamma=0.0, reward_coef=0.1, teacher_coef=0))
    assert adv.tolist() == [[0.0, 0.5]]
    with pytest.raises(ValueError, match="needs the teacher's log-ratio"):
        compute_advantages("reverse-kl", without_teacher, AdvantageConfig(gamma=0.0))


def test_critic_free_advantage_is_constant_along_the_response_without_kl():
    inputs, lengths = make_inputs(2, 4, 6, seed=5, with_kl=False)
    adv, _ = compute_advantages("rloo", inputs, AdvantageConfig(gamma=1.0))
    for b, length in enumerate(lengths):
        assert torch.allclose(adv[b, :length], adv[b, 0].expand(length))


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_estimators_refuse_groups_without_a_baseline(name):
    inputs, _ = make_inputs(3, 1, 4, seed=0)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        compute_advantages(name, inputs)
    inputs, _ = make_inputs(1, 5, 4, seed=0)
    inputs.n_samples_per_prompt = 2  # 5 rows do not split into groups of 2
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        compute_advantages(name, inputs)


def test_gae_needs_values():
    inputs, _ = make_inputs(1, 2, 3, seed=0)
    inputs.values = None
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", inputs)


def test_gae_returns_are_not_whitened():
    inputs, lengths = make_inputs(2, 2, 5, seed=11)
    adv_w, ret_w = compute_advantages("gae", inputs, AdvantageConfig(whiten=True))
    adv_raw, ret_raw = compute_advantages("gae", inputs, AdvantageConfig(whiten=False))
    torch.testing.assert_close(ret_w, ret_raw, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret_raw, (adv_raw + inputs.values) * inputs.action_mask, atol=ATOL, rtol=0)
    assert not torch.allclose(adv_w, adv_raw)


@pytest.mark.parametrize("name", NAMES)
def test_observation_tokens_between_turns_are_not_steps(name):
    """A multi-turn episode's observation tokens (action_mask 0 between policy tokens) leave every
    estimator's result on the policy's tokens as if they were not there, with gamma and lambda < 1."""
    inputs, _ = make_inputs(2, 2, 6, seed=3)
    inputs.action_mask[:] = True
    cfg = AdvantageConfig(gamma=0.9, lambd=0.8, whiten=False)
    gap = torch.tensor([True, True, False, False, False, True, True, True, True])  # 3 observation tokens
    spread = AdvantageInputs(
        rewards=inputs.rewards, action_mask=gap.expand(4, -1).clone(), n_samples_per_prompt=2,
        kl_penalty=inputs.kl_penalty.new_zeros(4, 9).masked_scatter(gap.expand(4, -1), inputs.kl_penalty),
        values=inputs.values.new_zeros(4, 9).masked_scatter(gap.expand(4, -1), inputs.values) + 5 * ~gap,
        log_ratio=inputs.log_ratio.new_zeros(4, 9).masked_scatter(gap.expand(4, -1), inputs.log_ratio) + 5 * ~gap,
        teacher_log_ratio=inputs.teacher_log_ratio.new_zeros(4, 9).masked_scatter(
            gap.expand(4, -1), inputs.teacher_log_ratio) + 5 * ~gap)
    expected = compute_advantages(name, inputs, cfg)
    got = compute_advantages(name, spread, cfg)
    for wanted, found in zip(expected, got):
        torch.testing.assert_close(found[:, gap], wanted, atol=ATOL, rtol=0)
        assert not found[:, ~gap].any()


# ---------------------------------------------------------------------------------------------
# the Experience record that carries advantages into the update
# ---------------------------------------------------------------------------------------------


def make_experience(b: int, prompt: int, t: int, seed: int):
    from rlhf_trainer.experience import Experience

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    seq = torch.randint(1, 100, (b, prompt + t), generator=gen)
    return Experience(
        sequences=seq,
        attention_mask=torch.ones_like(seq),
        action_mask=mask,
        action_log_probs=-torch.rand(b, t, generator=gen, dtype=torch.float64),
        advantages=torch.randn(b, t, generator=gen, dtype=torch.float64),
        rewards=torch.randn(b, generator=gen, dtype=torch.float64),
        response_length=lengths,
        info={"score": torch.randn(b, generator=gen, dtype=torch.float64)},
    )


def test_experience_concat_aligns_prompts_left_and_responses_right():
    from rlhf_trainer.experience import Experience

    a = make_experience(2, prompt=3, t=4, seed=0)
    b = make_experience(3, prompt=5, t=2, seed=1)
    both = Experience.concat([a, b], pad_token_id=-1)
    assert both.sequences.shape == (5, 5 + 4) and both.action_mask.shape == (5, 4)
    # the last T positions of sequences are still the response tokens of every row
    torch.testing.assert_close(both.sequences[:2, -4:], a.sequences[:, -4:])
    torch.testing.assert_close(both.sequences[2:, -4:-2], b.sequences[:, -2:])
    assert (both.sequences[:2, :2] == -1).all() and (both.attention_mask[:2, :2] == 0).all()
    assert (both.sequences[2:, -2:] == -1).all() and not both.action_mask[2:, -2:].any()
    torch.testing.assert_close(both.advantages[2:, :2], b.advantages)
    torch.testing.assert_close(both.info["score"], torch.cat([a.info["score"], b.info["score"]]))


def test_experience_concat_pads_the_teacher_s_top_k_on_the_response_side():
    from dataclasses import replace

    from rlhf_trainer.experience import Experience

    def with_teacher(exp: Experience, k: int = 3) -> Experience:
        b, t = exp.action_mask.shape
        return replace(exp, teacher_logps=-torch.rand(b, t, k, dtype=torch.float64),
                       teacher_ids=torch.randint(0, 100, (b, t, k)))

    a, b = with_teacher(make_experience(2, prompt=3, t=4, seed=0)), with_teacher(make_experience(3, prompt=5, t=2, seed=1))
    both = Experience.concat([a, b])
    assert both.teacher_logps.shape == both.teacher_ids.shape == (5, 4, 3)
    torch.testing.assert_close(both.teacher_logps[2:, :2], b.teacher_logps)  # the response's first tokens
    assert not both.teacher_logps[2:, 2:].any() and not both.teacher_ids[2:, 2:].any()
    torch.testing.assert_close(Experience.concat(both.split(2)).teacher_ids, both.teacher_ids)
    with pytest.raises(ValueError, match=r"teacher_ids has shape \(5, 4\), expected \(5, 4, 'k'\)"):
        replace(both, teacher_ids=both.teacher_ids[..., 0])


def test_experience_split_round_trips_and_moves():
    from rlhf_trainer.experience import Experience

    exp = make_experience(7, prompt=2, t=5, seed=3)
    parts = exp.split(3)
    assert [p.batch_size for p in parts] == [3, 3, 1]
    again = Experience.concat(parts)
    for name in ("sequences", "action_mask", "advantages", "rewards", "response_length"):
        torch.testing.assert_close(getattr(again, name), getattr(exp, name))
    moved = exp.to("cpu")
    assert moved is not exp and moved.info["score"].device.type == "cpu"


def test_experience_refuses_inconsistent_shapes():
    from rlhf_trainer.experience import Experience

    exp = make_experience(2, prompt=2, t=3, seed=0)
    with pytest.raises(ValueError, match="advantages"):
        Experience(exp.sequences, exp.attention_mask, exp.action_mask, exp.action_log_probs,
                   advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="rewards"):
        Experience(exp.sequences, exp.attention_mask, exp.action_mask, exp.action_log_probs,
                   rewards=torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# TRL as an oracle (trl is a dev-only dependency; these tests skip without it)
#
# TRL 1.16 computes GRPO and RLOO advantages inline in `_generate_and_score_completions` (no public
# function computes them). We run that real method on a trainer object without its __init__
# (conftest's trl_trainer), setting only the attributes it reads and stubbing generation, log-prob
# and reward calls, so TRL's own arithmetic is the oracle.
# TRL's advantages are per sequence [B]; ours are per token [B, T] and equal them on every valid
# token when gamma = 1, no KL penalty and no whitening (the configuration compared here).
# Known differences, not compared: TRL's GRPO divides by (std + 1e-4) (we set eps=1e-4 to match);
# TRL's RLOO subtracts a per-sequence sum of k1 KL from the score *before* the leave-one-out
# baseline, whereas we keep the KL as a per-token reward penalty after shaping; TRL's optional
# advantage normalization is over sequences with (std + 1e-4), ours whitens over tokens; TRL 1.16
# ships no PPO trainer, so `gae` and whitening have only the loop reference above.
# ---------------------------------------------------------------------------------------------


def _trl_scored_advantages(trl_trainer, trainer_cls, rewards: torch.Tensor, n: int, lengths: list[int], **attrs):
    import collections
    import types

    b = rewards.shape[0]
    completions = [[7] * max(length, 1) for length in lengths]
    settings = dict(
        model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False),
        num_generations=n,
        beta=0.0,
        _tokenizer=types.SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=False,
        args=types.SimpleNamespace(
            per_device_train_batch_size=b,
            gradient_checkpointing_kwargs=None,
            steps_per_generation=1,
            gradient_accumulation_steps=1,
        ),
        reward_weights=torch.ones(1, dtype=rewards.dtype),
        reward_clip_range=None,
        reward_func_names=["score"],
        _logs={
            "prompt": [], "completion": [], "advantages": [], "images": [],
            "rewards": collections.defaultdict(list), "extra": collections.defaultdict(list),
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
        # GRPO-only switches, all off
        environment_factories=None, tools=None, environments=None, use_vllm=False, num_iterations=1,
        _is_vlm=False, multi_objective_aggregation="sum_then_normalize",
        # stubs for generation, log-probs and rewards
        _get_per_token_logps_and_entropies=lambda model, ids, mask, keep, *a, **k: (
            torch.zeros(ids.shape[0], keep, dtype=rewards.dtype), None, None
        ),
        _calculate_rewards=lambda inputs, prompts, completions, ids: rewards.unsqueeze(1),
    )
    prompts = [[1, 2]] * b
    if trainer_cls.__name__ == "RLOOTrainer":
        settings["_generate"] = lambda p: (prompts, completions, ["text"] * b)
    else:
        settings["_generate"] = lambda p: (prompts, completions, None, ["text"] * b, None, {}, None, None)
    settings.update(attrs)
    return trl_trainer(trainer_cls, **settings)._generate_and_score_completions([{"prompt": "p"}] * b)["advantages"]


@pytest.mark.parametrize("n_prompts,n,t,seed", [(1, 2, 3, 0), (3, 4, 7, 1), (5, 8, 12, 2)])
@pytest.mark.parametrize(
    "name,trainer,attrs",
    [
        ("group-norm", "GRPOTrainer", {"scale_rewards": "group"}),
        ("dr-grpo", "GRPOTrainer", {"scale_rewards": "none"}),
        ("rloo", "RLOOTrainer", {"normalize_advantages": False}),
    ],
)
def test_sequence_advantages_match_trl(name, trainer, attrs, n_prompts, n, t, seed, trl_trainer):
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.rloo_trainer import RLOOTrainer

    trainer_cls = {"GRPOTrainer": GRPOTrainer, "RLOOTrainer": RLOOTrainer}[trainer]
    inputs, lengths = make_inputs(n_prompts, n, t, seed, with_kl=False)
    if n_prompts > 1:
        inputs.rewards[n : 2 * n] = 0.5  # a zero-std group
    trl_adv = _trl_scored_advantages(trl_trainer, trainer_cls, inputs.rewards, n, lengths, **attrs)
    ours, _ = compute_advantages(name, inputs, AdvantageConfig(gamma=1.0, whiten=False, eps=1e-4))
    expected = trl_adv.unsqueeze(1).expand_as(ours) * inputs.action_mask
    torch.testing.assert_close(ours, expected.to(ours.dtype), atol=ATOL, rtol=0)
