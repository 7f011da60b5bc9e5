"""The offline algorithms train through `rlhf run` (tiny model, CPU, toy letter data written here):
sft lowers the response NLL, dpo/ipo/cdpo/kto raise the implicit reward margin of chosen over
rejected on held-in pairs, and a reward model trained with rm ranks chosen above rejected far more
often than chance; pipelines of stages (`rlhf run DIR`) hand one stage's model to the next."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_api.v1alpha1 import DataSpec, DatasetSpec
from rlhf_trainer.losses import masked_sum, token_log_probs
from rlhf_trainer.offline_data import OfflineDataset, pack
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import EXIT_INVALID, run, run_pipeline
from rlhf_trainer.data import conditioned
from rlhf_trainer.tiny import TOY_LETTERS, one_letter_task, toy_prompts
from rlhf_trainer.workers.engine import position_ids

pytestmark = pytest.mark.timeout(600)

MAX_PROMPT_TOKENS, MAX_TOKENS = 48, 64


def _sft_records(count: int) -> list[dict]:
    return [{"prompt": r["prompt"], "response": r["label"] * 4} for r in toy_prompts(count, seed=1)]


def _pair_records(count: int) -> list[dict]:
    records = []
    for i, r in enumerate(toy_prompts(count, seed=2)):
        wrong = TOY_LETTERS[(TOY_LETTERS.index(r["label"]) + 1 + i % 3) % len(TOY_LETTERS)]
        records.append({"prompt": r["prompt"], "chosen": r["label"] * 4, "rejected": wrong * 4})
    return records


def _write_job(directory: Path, model: Path, algorithm: str, dataset: str, records: list[dict], **training) -> Path:
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": f"tiny-{algorithm}"},
        "spec": {
            "algorithm": algorithm,
            "models": {"actor": {"path": str(model), "dtype": "float32"}},
            "data": {dataset: {"sources": [{"path": data.name}]},
                     "maxPromptTokens": MAX_PROMPT_TOKENS, "maxTokens": MAX_TOKENS},
            "training": {"zeroStage": 2, "bf16": False, "lrWarmupRatio": 0.0, "lrScheduler": "constant",
                         "trainBatchSize": 16, "microTrainBatchSize": 8, "seed": 42, **training},
            "resources": {"nodes": 1, "gpusPerNode": 0},
            "checkpoint": {"path": "checkpoints", "intervalSteps": 0, "exportHf": True},
        },
    }
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _run(job: Path, out: Path) -> list[dict]:
    metrics_file = out / "metrics.jsonl"
    assert run(job, output_dir=out, reporters=[JsonlWriter(metrics_file)]) == 0
    return [json.loads(line) for line in metrics_file.read_text().splitlines()]


def _dataset(model: Path, records: list[dict], keys: tuple[str, ...], tmp_path: Path) -> tuple[OfflineDataset, int]:
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = AutoTokenizer.from_pretrained(model)
    dataset = OfflineDataset.from_spec(
        DatasetSpec(sources=[{"path": str(data)}]), DataSpec(max_prompt_tokens=MAX_PROMPT_TOKENS, max_tokens=MAX_TOKENS),
        tokenizer, response_keys=keys, base_dir=tmp_path, seed=0, name="eval")
    return dataset, tokenizer.pad_token_id


@torch.no_grad()
def _response_logps(model_dir: Path, dataset: OfflineDataset, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of every response [examples, responses] and their token counts, by the HF model."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    batch = pack(dataset.items, pad)
    logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask,
                   position_ids=position_ids(batch.attention_mask)).logits[:, -batch.num_actions - 1:-1]
    logps = masked_sum(token_log_probs(logits, batch.sequences[:, -batch.num_actions:]), batch.action_mask, dim=-1)
    shape = (len(dataset.items[0].responses), len(dataset))
    return logps.view(shape).T, batch.action_mask.sum(-1).view(shape).T


# algorithm -> training overrides; every one must make chosen beat rejected on its held-in pairs
PREFERENCE_CASES = {
    "dpo": ({"learningRate": 3.0e-3, "epochs": 6, "maxSteps": 24, "preference": {"beta": 0.5}}, 0.9),
    # Shorter runs: the same loop, another entry of PREFERENCE_LOSSES.
    "ipo": ({"learningRate": 3.0e-3, "epochs": 4, "maxSteps": 16, "preference": {"beta": 0.5}}, 0.75),
    "cdpo": ({"learningRate": 3.0e-3, "epochs": 4, "maxSteps": 16, "preference": {"beta": 0.5, "labelSmoothing": 0.1}},
             0.75),
}


@pytest.mark.parametrize("algorithm", PREFERENCE_CASES)
def test_preference_training_raises_the_implicit_reward_margin(algorithm, tiny_model, local_ray, tmp_path, capsys):
    overrides, accuracy = PREFERENCE_CASES[algorithm]
    records = _pair_records(64)
    job = _write_job(tmp_path, tiny_model, algorithm, "preferences", records, **overrides)
    metrics = _run(job, tmp_path / "out")
    assert {"loss", "learning_rate", "reward_accuracy", "reward_margin"} <= metrics[0].keys()

    dataset, pad = _dataset(tiny_model, records, ("chosen", "rejected"), tmp_path)
    reference, _ = _response_logps(tiny_model, dataset, pad)
    policy, _ = _response_logps(tmp_path / "out" / "checkpoints" / "final", dataset, pad)
    implicit = policy - reference  # [pairs, (chosen, rejected)]; beta left out
    margin = implicit[:, 0] - implicit[:, 1]
    held_in = {"margin": margin.mean().item(), "accuracy": (margin > 0).float().mean().item()}
    with capsys.disabled():
        print(f"\n{algorithm}: held-in implicit reward margin/accuracy {held_in} (0 and 0 before training); "
              f"training loss {[round(m['loss'], 3) for m in metrics]}, "
              f"batch accuracy {[round(m['reward_accuracy'], 2) for m in metrics]}")
    assert held_in["margin"] > 0 and held_in["accuracy"] >= accuracy, held_in
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def _ranking_accuracy(model_dir: Path, records: list[dict]) -> float:
    """How often the reward model, served as a `type: model` reward source, scores chosen above rejected."""
    from rlhf_trainer.data import render_prompt
    from rlhf_trainer.rewards.model import RewardModelScorer

    scorer = RewardModelScorer(str(model_dir), device="cpu")
    prompts = [render_prompt(r["prompt"], scorer.tokenizer, True) for r in records]
    chosen = scorer(prompts, [r["chosen"] for r in records])
    rejected = scorer(prompts, [r["rejected"] for r in records])
    return (chosen > rejected).float().mean().item()


def _mixed_pair_records(count: int) -> list[dict]:
    """Chosen repeats the prompt's letter; rejected mixes it with another (a reward a tiny
    classifier can learn in a few steps; telling one repeated letter from another takes longer)."""
    return [{**r, "rejected": r["chosen"][:2] + r["rejected"][:2]} for r in _pair_records(count)]


def test_reward_model_learns_to_rank_chosen_above_rejected(tiny_reward_model, local_ray, tmp_path, capsys):
    records = _mixed_pair_records(64)
    job = _write_job(tmp_path, tiny_reward_model, "rm", "preferences", records,
                     learningRate=1.0e-3, epochs=4, maxSteps=16)
    metrics = _run(job, tmp_path / "out")
    assert {"loss", "learning_rate", "reward_accuracy", "reward_margin"} <= metrics[0].keys()

    accuracy = {"before": _ranking_accuracy(tiny_reward_model, records),
                "after": _ranking_accuracy(tmp_path / "out" / "checkpoints" / "final", records)}
    with capsys.disabled():
        print(f"\nrm: held-in ranking accuracy {accuracy}; training loss {[round(m['loss'], 3) for m in metrics]}")
    assert accuracy["after"] >= 0.8 and accuracy["after"] > accuracy["before"] + 0.2, accuracy
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_kto_on_flagged_responses_raises_the_implicit_reward_margin(tiny_model, local_ray, tmp_path, capsys):
    pairs = _pair_records(64)
    # Unpaired: each prompt with one response, desirable or not, half and half.
    flagged = [{"prompt": p["prompt"], "response": p["chosen"] if i % 2 else p["rejected"], "desirable": bool(i % 2)}
               for i, p in enumerate(pairs)]
    job = _write_job(tmp_path, tiny_model, "kto", "preferences", flagged,
                     learningRate=3.0e-3, epochs=4, maxSteps=16, preference={"beta": 0.5})
    job_dict = yaml.safe_load(job.read_text())
    job_dict["spec"]["data"]["preferences"].update(outputKey="response", labelKey="desirable")
    job.write_text(yaml.safe_dump(job_dict))
    metrics = _run(job, tmp_path / "out")
    assert {"loss", "learning_rate", "reward_margin", "kto_reference_point"} <= metrics[0].keys()

    dataset, pad = _dataset(tiny_model, pairs, ("chosen", "rejected"), tmp_path)
    reference, _ = _response_logps(tiny_model, dataset, pad)
    policy, _ = _response_logps(tmp_path / "out" / "checkpoints" / "final", dataset, pad)
    implicit = policy - reference
    margin = implicit[:, 0] - implicit[:, 1]  # on the full pairs: half of each was never seen
    held_in = {"margin": margin.mean().item(), "accuracy": (margin > 0).float().mean().item()}
    with capsys.disabled():
        print(f"\nkto: implicit reward margin/accuracy on the pairs {held_in} (0 and 0 before training); "
              f"training loss {[round(m['loss'], 3) for m in metrics]}")
    assert held_in["margin"] > 0 and held_in["accuracy"] >= 0.75, held_in
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_offline_run_resumes_from_its_checkpoint(tiny_model, local_ray, tmp_path):
    job = _write_job(tmp_path, tiny_model, "sft", "sft", _sft_records(32), learningRate=1.0e-3, epochs=3, maxSteps=3)
    spec = yaml.safe_load(job.read_text())
    spec["spec"]["checkpoint"].update(intervalSteps=2, exportHf=False)
    job.write_text(yaml.safe_dump(spec))
    assert [m["step"] for m in _run(job, tmp_path / "out")] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step-*")) == ["step-00000002",
                                                                                          "step-00000003"]

    spec["spec"]["training"]["maxSteps"] = 5
    job.write_text(yaml.safe_dump(spec))
    metrics_file = tmp_path / "out" / "resumed.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [m["step"] for m in metrics] == [4, 5]
    assert metrics[0]["epoch"] == pytest.approx(2.0)  # 2 batches of 16 per epoch: step 4 ends the second epoch


def _stage(job_file: Path, name: str, **actor) -> dict:
    job = yaml.safe_load(job_file.read_text())
    job["metadata"]["name"] = name
    job["spec"]["models"]["actor"] = {**job["spec"]["models"]["actor"], **actor}
    return job


def test_sft_lowers_the_response_nll_and_the_pipeline_s_next_stage_starts_from_its_model(tiny_model, local_ray,
                                                                                        tmp_path, capsys):
    """`rlhf run DIR`: the stages run in dependency order whatever the files' order. The first, sft, lowers
    the records' response NLL (Hugging Face's, of its exported model) below half the base model's; the second
    sft starts from that model (models.actor.fromJob): its first loss is about the first stage's last, far
    below the base model's."""
    records = _sft_records(64)
    job = _write_job(tmp_path, tiny_model, "sft", "sft", records, learningRate=5.0e-3, epochs=3, maxSteps=12)
    stages = tmp_path / "pipeline"
    stages.mkdir()
    shutil.copy(tmp_path / "data.jsonl", stages)
    second = _stage(job, "polish", fromJob={"name": "base-sft"})
    del second["spec"]["models"]["actor"]["path"]
    second["spec"]["training"]["maxSteps"] = 2
    (stages / "a-polish.yaml").write_text(yaml.safe_dump(second))  # named first, runs second
    (stages / "b-base-sft.yaml").write_text(yaml.safe_dump(_stage(job, "base-sft")))

    assert run_pipeline([stages], output_dir=tmp_path / "out") == 0
    losses = {name: [json.loads(line)["loss"] for line in (tmp_path / "out" / name / "checkpoints" / "logs" /
                                                          "metrics.jsonl").read_text().splitlines()]
              for name in ("base-sft", "polish")}
    with capsys.disabled():
        print(f"\npipeline: loss per step {({name: [round(x, 3) for x in values] for name, values in losses.items()})}")
    assert len(losses["base-sft"]) == 12 and len(losses["polish"]) == 2
    assert losses["polish"][0] < 0.5 * losses["base-sft"][0], losses
    assert losses["base-sft"][-1] < losses["base-sft"][0]

    dataset, pad = _dataset(tiny_model, records, ("response",), tmp_path)
    nll = {}
    for name, model in {"before": tiny_model, "after": tmp_path / "out" / "base-sft" / "checkpoints" / "final"}.items():
        logps, tokens = _response_logps(model, dataset, pad)
        nll[name] = (-logps.sum() / tokens.sum()).item()
    with capsys.disabled():
        print(f"sft: response NLL per token {nll}")
    assert nll["after"] < 0.5 * nll["before"], nll


def test_a_pipeline_that_cannot_run_is_refused_before_anything_loads(tiny_model, tmp_path, capsys):
    job = _write_job(tmp_path, tiny_model, "sft", "sft", _sft_records(8))
    ping, pong = (_stage(job, name, fromJob={"name": other}) for name, other in (("ping", "pong"), ("pong", "ping")))
    for stage in (ping, pong):
        del stage["spec"]["models"]["actor"]["path"]
        (tmp_path / f"{stage['metadata']['name']}.yaml").write_text(yaml.safe_dump(stage))
    assert run_pipeline([tmp_path / "ping.yaml", tmp_path / "pong.yaml"]) == EXIT_INVALID
    assert "in a cycle (ping <- pong <- ping)" in capsys.readouterr().err
    assert run_pipeline([tmp_path / "ping.yaml"]) == EXIT_INVALID
    assert "models.actor.fromJob names RLHFJob pong, which none of the files defines" in capsys.readouterr().err


def _scored_records(count: int, seed: int) -> list[dict]:
    """Each prompt three times: the right letter scored 2, twice a refusal scored 0 (a third of the data good)."""
    records = []
    for r in toy_prompts(count, seed=seed):
        records.append({"prompt": r["prompt"], "response": r["label"] * 4, "score": 2})
        records += [{"prompt": r["prompt"], "response": "No.", "score": 0}] * 2
    return records


def test_csft_asked_for_the_top_score_writes_what_sft_on_the_same_data_does_not(tiny_model, local_ray, tmp_path,
                                                                               capsys):
    """Conditional SFT (SteerLM): on data of mixed quality (two refusals scored 0 for each right answer
    scored 2), a held-out prompt asking for the top score is answered rather than refused; plain SFT on
    the same records refuses two times in three. Measured: the log-probability of the refusal."""
    template = DataSpec().score_template
    held_out = [{"prompt": r["prompt"], "response": "No."} for r in toy_prompts(48, seed=7)]
    refusal = {}
    for algorithm in ("sft", "csft"):
        directory = tmp_path / algorithm
        directory.mkdir()
        job_file = _write_job(directory, tiny_model, algorithm, "sft", _scored_records(64, seed=3),
                              learningRate=5.0e-3, epochs=5, maxSteps=60)
        job = yaml.safe_load(job_file.read_text())
        if algorithm == "csft":
            job["spec"]["data"]["sft"]["scoreKey"] = "score"
        job_file.write_text(yaml.safe_dump(job))
        _run(job_file, directory / "out")
        asked = [{**r, "prompt": conditioned(r["prompt"], 2, template) if algorithm == "csft" else r["prompt"]}
                 for r in held_out]
        dataset, pad = _dataset(tiny_model, asked, ("response",), directory)
        logps, _ = _response_logps(directory / "out" / "checkpoints" / "final", dataset, pad)
        refusal[algorithm] = logps.mean().item()
    with capsys.disabled():
        print(f"\ncsft: held-out log-probability of refusing {refusal}")
    assert refusal["sft"] > math.log(0.4), refusal  # it learnt the data's mixture: refusals two times in three
    assert refusal["csft"] < refusal["sft"] - 2.0, refusal  # asked for the top score: e^2 times less likely


# GRPO stage: steps and the required rise of the task's 5-step mean reward. Measured 2026-11-27: 0.085 -> 0.446
# (gain 0.36, the reward model's score -2.8 -> 2.2); against the untrained reward model instead, the task's
# reward fell, 0.059 -> 0.021, while that model's own score rose.
GRPO_STEPS, GRPO_GAIN = 10, 0.15


def test_grpo_against_the_reward_model_its_pipeline_trained_learns_the_task(
        tiny_reward_model, toy_job, local_ray, tmp_path, capsys):
    """SFT -> RM -> PPO's hand-over, trained: `rlhf run DIR` trains a reward model on pairs that prefer the
    letter every prompt asks for ("a"), then a GRPO stage whose reward group loads it (models.reward.fromJob)
    and whose only reward that counts is its score. The task's own reward, a source weighted 1e-6 that only
    watches, rises: the policy learnt the task from the model the first stage trained (an untrained reward
    model has no reason to prefer "a")."""
    stages = tmp_path / "pipeline"
    stages.mkdir()
    asked, pairs = one_letter_task("a")
    rm = _stage(_write_job(tmp_path, tiny_reward_model, "rm", "preferences", pairs,
                           learningRate=1.0e-3, epochs=1, maxSteps=16), "letters-rm")
    shutil.copy(tmp_path / "data.jsonl", stages)
    grpo = _stage(toy_job(**{"training.maxSteps": GRPO_STEPS, "training.episodes": 3, "checkpoint.intervalSteps": 0,
                             "checkpoint.exportHf": False,
                             "models.reward": {"fromJob": {"name": "letters-rm"}, "dtype": "float32"}}), "letters-grpo")
    shutil.copytree(tmp_path / "tiny", stages / "tiny")
    (stages / "tiny" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in asked))
    letter = grpo["spec"]["reward"]["sources"][0]
    grpo["spec"]["reward"]["sources"] = [{"name": "rm", "type": "model"}, {**letter, "weight": 1e-6}]
    for name, stage in (("1-rm.yaml", rm), ("2-grpo.yaml", grpo)):
        (stages / name).write_text(yaml.safe_dump(stage))

    assert run_pipeline([stages], output_dir=tmp_path / "out") == 0
    metrics = [json.loads(line) for line in (tmp_path / "out" / "letters-grpo" / "checkpoints" / "logs" /
                                             "metrics.jsonl").read_text().splitlines()]
    task = [m[f"reward/{letter['name']}"] for m in metrics]
    with capsys.disabled():
        print(f"\nrm -> grpo: task reward per step {[round(r, 3) for r in task]}, "
              f"reward model's {[round(m['reward/rm'], 3) for m in metrics]}")
    assert len(metrics) == GRPO_STEPS
    assert sum(task[-5:]) / 5 > sum(task[:5]) / 5 + GRPO_GAIN, task


def test_kd_learns_from_the_teacher_what_the_data_s_responses_do_not_say(tiny_model, local_ray, tmp_path, capsys):
    """Knowledge distillation on data.sft: the records' responses are all refusals ("No."), but the teacher
    (the tiny model after SFT on the right answers) knows each prompt's letter. At held-out prompts the kd
    student gives the right answer a far higher log-probability than plain SFT on the same records: what it
    learnt there came from the teacher's distributions, not from the responses; with GKD's JSD (jsdBeta 0.5) in
    place of the forward KL too. Measured (deterministic, 2026-11-28): -7.3 for kd, -4.3 for kd with the JSD,
    against -19.0 for sft; the teacher KL per step 4.5 -> 0.78, the JSD 0.656 -> 0.526."""
    teacher_dir = tmp_path / "teacher"
    teacher_dir.mkdir()
    _run(_write_job(teacher_dir, tiny_model, "sft", "sft", _sft_records(64), learningRate=5.0e-3, epochs=5,
                    maxSteps=40), teacher_dir / "out")
    teacher = teacher_dir / "out" / "checkpoints" / "final"
    refusals = [{"prompt": r["prompt"], "response": "No."} for r in toy_prompts(64, seed=3)]
    held_out = [{"prompt": r["prompt"], "response": r["label"] * 4} for r in toy_prompts(48, seed=7)]
    right, divergences = {}, {}
    for name, algorithm, jsd_beta in (("sft", "sft", None), ("kd", "kd", None), ("kd-jsd", "kd", 0.5)):
        directory = tmp_path / name
        directory.mkdir()
        job_file = _write_job(directory, tiny_model, algorithm, "sft", refusals, learningRate=5.0e-3, epochs=5,
                              maxSteps=20)
        if algorithm == "kd":
            job = yaml.safe_load(job_file.read_text())
            job["spec"]["models"]["teacher"] = {"path": str(teacher), "dtype": "float32"}
            if jsd_beta is not None:  # GKD's generalized JSD in place of the forward KL
                job["spec"]["training"]["distillation"] = {"jsdBeta": jsd_beta}
            job_file.write_text(yaml.safe_dump(job))
        metrics = _run(job_file, directory / "out")
        dataset, pad = _dataset(tiny_model, held_out, ("response",), directory)
        logps, _ = _response_logps(directory / "out" / "checkpoints" / "final", dataset, pad)
        right[name] = logps.mean().item()
        metric = "teacher_jsd" if jsd_beta is not None else "teacher_kl"
        divergences[name] = [m[metric] for m in metrics] if algorithm == "kd" else None
    with capsys.disabled():
        print(f"\nkd: held-out log-probability of the right letter {right}; divergence from the teacher per step "
              f"{ {name: [round(k, 3) for k in d] for name, d in divergences.items() if d} }")
    # the JSD (beta 0.5) is bounded by log 2 and starts near it; the refusals' NLL holds both divergences up
    assert divergences["kd"][-1] < divergences["kd"][0] / 2, divergences
    assert divergences["kd-jsd"][-1] < divergences["kd-jsd"][0] * 0.9, divergences
    for name in ("kd", "kd-jsd"):
        assert right[name] > right["sft"] + 5.0, right
