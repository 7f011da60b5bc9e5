"""The online algorithms learn the toy task (tiny example job, CPU): the mean reward of the last
five steps beats the first five by a margin far beyond step-to-step noise (about 0.03 at the
start, where the reward itself is about 0.03).

The runs are deterministic (seeded sampling and data order): each case's steps are the fewest whose
measured gain (2026-11-26, in the comment beside it) keeps 1.4x or more over its bound; LoRA, which
learns late, keeps its 30 steps (1.16x)."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_api import contract
from rlhf_trainer import learning_signal
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import run
from tests.trainer.conftest import TEACHER_ALGORITHM, TEACHER_STEPS

pytestmark = pytest.mark.timeout(900)

# algorithm -> (spec overrides, steps, required gain of the 5-step mean reward); measured gain in comments
CASES = {
    "grpo": ({}, 15, 0.1),  # 0.142
    # The sequence ratio clipped to the catalogue's 3e-4 / 4e-4: each rollout's second optimizer step
    # (trainBatchSize is half the rollout) is off-policy and mostly clipped.
    "gspo": ({}, 15, 0.1),  # 0.139
    # ZeRO-3 for the actor, the critic (a value head on the actor) and the reference, which shares
    # the actor's bundle.
    "ppo": ({"training.zeroStage": 3, "training.criticLearningRate": 5.0e-3, "training.colocation": "actor-reference"},
            16, 0.1),  # 0.146
    "reinforce++": ({"rollout.samplesPerPrompt": 4, "training.rolloutBatchSize": 32}, 12, 0.03),  # 0.104
    # Rollouts generated one update ahead of training, paused by each weight sync and finished by the new
    # weights (partial rollouts), corrected for the engines' lag by truncated importance sampling.
    "rloo": ({"training.asyncQueueSize": 1, "rollout.partial": True, "training.rolloutCorrectionCap": 2.0},
             12, 0.03),  # 0.088 before partial rollouts
    # Rejection sampling: the likelihood of each prompt's best sample (of 8).
    "raft": ({}, 10, 0.05),  # 0.086
    # Online DPO: each prompt's best sample against its worst, one DPO step per rollout.
    "online-dpo": ({"training.trainBatchSize": 128}, 15, 0.07),  # 0.104
    # LoRA on the random tiny model: its frozen final norm (gain 1) and tied head (std 0.02) cap every
    # logit near 2.6, so adapters on the linear layers alone can raise no answer above ~5% (the KL to
    # the base stalls near 0.07 at any rank, alpha or learning rate). Training the final norm's gain
    # beside them lifts the cap. Gains measured: 0.116, and 0.091 in a whole run on 2026-11-26 (the gain varies
    # from run to run); 0.05 still needs a last-five mean above 0.08, past the cap.
    "grpo-lora": ({"algorithm": "grpo", "training.learningRate": 0.1,
                   "models.actor.lora": {"rank": 8, "alpha": 16, "modulesToSave": ["model.norm"]}}, 30, 0.05),
}

RUNS: dict[str, list[dict]] = {}  # test_reward_rises' metrics per case (the sequence-parallel run's baseline reuses grpo's)

# The share of samples an algorithm that picks some of each prompt's 8 trains on, at most.
TRAINED_AT_MOST = {"raft": 1 / 8, "online-dpo": 2 / 8}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.parametrize("algorithm", CASES)
def test_reward_rises(algorithm, toy_job, local_ray, tmp_path, capsys, request):
    overrides, steps, gain = CASES[algorithm]
    if algorithm == TEACHER_ALGORITHM:  # the distillation tests' teacher is this very run: its metrics, not a second one
        assert steps == TEACHER_STEPS and not overrides
        metrics_file = request.getfixturevalue("raft_teacher").parent / contract.LOGS_DIR / "metrics.jsonl"
    else:
        job = toy_job(**{"algorithm": algorithm, "training.maxSteps": steps, "training.episodes": 3,
                         "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False, **overrides})
        metrics_file = tmp_path / "out" / "metrics.jsonl"
        assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0

    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    RUNS[algorithm] = metrics
    rewards = [m["reward_mean"] for m in metrics]
    with capsys.disabled():
        print(f"\n{algorithm}: mean reward per step {[round(r, 3) for r in rewards]}")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert _mean(rewards[-5:]) > _mean(rewards[:5]) + gain, rewards
    if algorithm in TRAINED_AT_MOST:  # some samples trained on every step, never more than the algorithm picks
        assert all(0 < m["trained_fraction"] <= TRAINED_AT_MOST[algorithm] for m in metrics), metrics

    # The weight sync, checked at every step: vLLM's log-probs of what it sampled are the actor's.
    # With asynchronous rollouts the engines are one update behind by design.
    drift = [m["logprob_diff"] for m in metrics[1:]]
    lag = overrides.get("training.asyncQueueSize", 0)  # every token of a step's samples at most this many updates old
    assert max(m["rollout/staleness_max"] for m in metrics) == lag, metrics
    if lag:
        assert min(drift) > 1e-4, drift
        assert all("rollout_correction_clipped_fraction" in m for m in metrics)
    else:
        assert max(drift) < 1e-4, drift


# Sequence parallelism 2 (training.sequenceParallel: the actor's and the reference's rows split over 2 ranks each)
# trains the grpo case's job as one rank does. The first SP_STEPS steps of that case (constant learning rate: a
# longer run's first steps are these) are the baseline, run here only when that case did not run first. Seen
# (2026-11-28, 3 steps): the same rewards to the last digit (the engines sample the same tokens), kl, entropy,
# policy loss and gradient norm within 1e-6 relative. A sampled token that flipped on float32 noise would move a
# step's mean reward by about 1e-3 (one token of 8 in one of 128 samples): the bounds allow a few such flips,
# while a split that trained wrong moves the policy off within a step (the KL after step 2 is 0.06).
SP_STEPS = 5
SP_TOLERANCE = {"reward_mean": 0.01, "kl": 0.02, "entropy": 0.02, "actor/grad_norm": 0.02}  # reward absolute, the rest relative


def _metrics_of(job, out) -> list[dict]:
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sequence_parallel_2_trains_the_grpo_job_as_one_rank(toy_job, local_ray, tmp_path, capsys):
    common = {"training.maxSteps": SP_STEPS, "training.episodes": 3, "checkpoint.intervalSteps": 0,
              "checkpoint.exportHf": False}
    baseline = RUNS.get("grpo") or _metrics_of(toy_job(**common), tmp_path / "one-rank")
    split = _metrics_of(toy_job(**common, **{"training.sequenceParallel": {"size": 2},
                                             "resources.gpus": {"actor": 2, "reference": 2}}), tmp_path / "split")
    with capsys.disabled():
        print(f"\nsequence parallel 2: mean reward per step {[round(m['reward_mean'], 4) for m in split]}")
    assert len(split) == SP_STEPS
    for one_rank, two_ranks in zip(baseline, split):
        assert abs(two_ranks["reward_mean"] - one_rank["reward_mean"]) <= SP_TOLERANCE["reward_mean"], (one_rank, two_ranks)
        for key in ("kl", "entropy", "actor/grad_norm"):
            assert two_ranks[key] == pytest.approx(one_rank[key], rel=SP_TOLERANCE[key], abs=1e-6), (key, one_rank, two_ranks)


# The KL term in the loss (GRPO's placement) holds the policy near the reference. Measured on this
# job (8 steps, deterministic, 2026-11-26): with coefficient 1 the mean KL of the last five steps is
# 0.086 (k3; k2 0.082), no step above 0.093; with the toy job's own coefficient, 0.001, it grows every step
# (0.82 at step 8, the last five 0.52; 0.49 with 1e-9). The bound 0.3 sits 3.5 times above the first and
# 1.7 times below the second: a policy step that drops the KL term (or its coefficient) trains like the
# weak case and fails. The weak case is test_reward_rises[grpo]'s first KL_STEPS steps (a constant learning
# rate: a longer run's first steps are these), run here only when that case did not run first. k2 differs
# from k3 only in the estimator, whose values test_kl.py checks against its formula.
KL_STEPS, KL_BOUND = 8, 0.3


def _last_five_kl(kls: list[float], case: str, capsys) -> float:
    with capsys.disabled():
        print(f"\nkl {case}: mean KL per step {[round(k, 3) for k in kls]}")
    assert len(kls) == KL_STEPS
    return _mean(kls[-5:])


def test_kl_in_the_loss_holds_the_policy_near_the_reference(toy_job, local_ray, tmp_path, capsys):
    def kls(out, **kl) -> list[float]:
        job = toy_job(**{"training.maxSteps": KL_STEPS, "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                         **({"training.kl": kl} if kl else {})})
        return [m["kl"] for m in _metrics_of(job, out)]

    held = kls(tmp_path / "k3", coef=1.0, estimator="k3", placement="loss")
    weak = [m["kl"] for m in RUNS["grpo"][:KL_STEPS]] if "grpo" in RUNS else kls(tmp_path / "weak")
    assert _last_five_kl(held, "coefficient 1", capsys) < KL_BOUND, held
    assert _last_five_kl(weak, "coefficient 0.001", capsys) > KL_BOUND, weak


# A run that cannot learn says so (rlhf_trainer/learning_signal.py). -------------------------------------

def test_equal_rewards_within_every_group_are_no_signal():
    assert not learning_signal.has_signal(torch.tensor([0.0, 0.0, 1.0, 1.0]), samples_per_prompt=2)
    assert learning_signal.has_signal(torch.tensor([0.0, 0.0, 1.0, 0.5]), samples_per_prompt=2)
    # One sample per prompt (a critic's baseline): the batch is the group.
    assert learning_signal.has_signal(torch.tensor([0.0, 1.0]), samples_per_prompt=1)
    assert not learning_signal.has_signal(torch.tensor([0.3, 0.3]), samples_per_prompt=1)
    assert learning_signal.condition({"reward_mean": 0.5}) is None  # an evaluation's metrics
    assert learning_signal.condition({learning_signal.METRIC: 1})["status"] == "False"
    stalled = learning_signal.condition({learning_signal.METRIC: learning_signal.STALL_STEPS, "reward_mean": 0.0})
    assert stalled["status"] == "True" and "3 steps in a row" in stalled["message"]


def test_a_run_whose_rewards_never_differ_says_so(toy_job, local_ray, tmp_path, caplog):
    """Every reward 0 (a task the model never gets right): the steps are counted, the log says so once,
    and the run goes on (the user decides)."""
    (tmp_path / "tiny" / "zero.py").parent.mkdir(exist_ok=True)
    (tmp_path / "tiny" / "zero.py").write_text("def score(prompts, completions, labels):\n    return [0.0] * len(completions)\n")
    steps = learning_signal.STALL_STEPS + 1
    job = toy_job(**{"training.maxSteps": steps, "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                     "reward.sources": [{"name": "zero", "type": "function", "function": {"entrypoint": "tiny/zero.py:score"}}]})
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0
    counted = [json.loads(line)[learning_signal.METRIC] for line in metrics_file.read_text().splitlines()]
    assert counted == list(range(1, steps + 1))
    warnings = [r.getMessage() for r in caplog.records if r.name == learning_signal.log.name]
    assert len(warnings) == 1 and f"no learning signal for {learning_signal.STALL_STEPS} steps" in warnings[0], warnings


def test_a_distill_run_without_any_reward_is_no_run_without_signal(toy_job, tiny_model, local_ray, tmp_path, caplog):
    """distill learns from its teacher: rewards that never differ (here none at all: no spec.reward) are
    not counted as steps without signal, and nothing says the run cannot learn."""
    steps = learning_signal.STALL_STEPS + 1
    job = toy_job(**{"algorithm": "distill", "models.teacher": {"path": str(tiny_model)}, "reward": None,
                     "training.kl": {"coef": 0}, "training.maxSteps": steps, "checkpoint.intervalSteps": 0,
                     "checkpoint.exportHf": False})
    metrics_file = tmp_path / "out" / "metrics.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert len(metrics) == steps and all(m["reward_mean"] == 0 and "teacher_kl" in m for m in metrics), metrics
    assert not any(learning_signal.METRIC in m for m in metrics), metrics
    assert not [r for r in caplog.records if r.name == learning_signal.log.name]


# On-policy distillation (distill): a student learns the task from a teacher alone. ------------------

# Measured (2026-11-28; the teacher's own last step 0.179), the first step's reward to the last five steps' mean:
# the sampled token's reverse KL 0.030 -> 0.177 (teacher_kl 2.12 -> 0.24); GKD's JSD (beta 0.5) 0.030 -> 0.213,
# at the teacher's level from step 4 on (teacher_jsd 0.58 -> 0.0004): the whole distribution at every position
# teaches more per sample than the sampled token's log-ratio.
DISTILL_STEPS, DISTILL_GAIN = 15, 0.1


@pytest.mark.parametrize("jsd_beta, metric", [(None, "teacher_kl"), (0.5, "teacher_jsd")],
                         ids=["reverse-kl-reward", "gkd-jsd"])
def test_a_student_distilled_from_a_trained_teacher_learns_the_task_without_its_reward(
        toy_job, raft_teacher, tmp_path, capsys, jsd_beta, metric):
    """The student is the untrained tiny model, trained from raft's teacher with the reward's weight 0: the
    reward only measures. Either on the teacher's log-probs of the sampled tokens (the reverse KL in the
    reward) or, with jsdBeta, on GKD's divergence from its top-k distributions in the loss. Its reward rises
    and its divergence from the teacher falls."""
    out = tmp_path / "student"
    student = toy_job(**{"algorithm": "distill", "models.teacher": {"path": str(raft_teacher)},
                         "training.distillation": {"jsdBeta": jsd_beta} if jsd_beta is not None else None,
                         "training.kl": {"coef": 0}, "training.maxSteps": DISTILL_STEPS, "training.episodes": 3,
                         "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False})
    assert run(student, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards, divergences = [m["reward_mean"] for m in metrics], [m[metric] for m in metrics]
    with capsys.disabled():
        print(f"\ndistill ({metric}): mean reward per step {[round(r, 3) for r in rewards]}, "
              f"{metric} {[round(k, 3) for k in divergences]}")
    assert _mean(rewards[-5:]) > rewards[0] + DISTILL_GAIN, rewards  # step 1 samples the untrained student
    assert _mean(divergences[-5:]) < divergences[0] / 2, divergences

