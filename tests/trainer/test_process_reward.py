"""Process reward models (algorithm prm; Lightman et al. 2023, Math-Shepherd): where a step's score is read
(rewards/process.py), the step-labelled records (offline_data), and a tiny PRM trained by `rlhf run` that
learns held-out steps' labels and then serves a GRPO stage as its reward, read step by step."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from rlhf_api.v1alpha1 import DataSpec, DatasetSpec, StepReward
from rlhf_trainer.data import render_prompt
from rlhf_trainer.losses import process_reward_loss, step_accuracy
from rlhf_trainer.offline_data import OfflineDataset, pack
from rlhf_trainer.rewards import RewardModelScorer
from rlhf_trainer.rewards.process import STEP_AGGREGATIONS, read_texts, reward_of, split_steps, step_token_ids
from rlhf_trainer.run import run_pipeline
from rlhf_trainer.tiny import TOY_LETTERS, one_letter_task, toy_prompts

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("completion, steps", [
    ("a\nbb\nc", ["a", "bb", "c"]),
    ("a\nbb\n", ["a", "bb"]),  # a trailing separator ends the last step; no empty step after it
    ("abc", ["abc"]),
    ("", [""]),  # an empty completion is one empty step, scored at the separator after it
    ("a\n\nb", ["a", "", "b"]),
])
def test_a_completion_s_steps_are_the_text_between_separators(completion, steps):
    assert split_steps(completion, "\n") == steps


def test_each_step_is_read_at_the_last_token_of_the_separator_after_it(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    read = step_token_ids(tokenizer, ["aaaa", "bb", "c"], " Step:")
    separator = tokenizer(" Step:", add_special_tokens=False)["input_ids"]
    assert len(separator) > 1 and len(read.positions) == 3
    for end in read.positions:
        assert read.ids[end - len(separator) + 1:end + 1] == separator
    assert tokenizer.decode(read.ids) == "aaaa Step:bb Step:c Step:"

    prompt = "Say a."
    [text] = read_texts(tokenizer, [prompt], ["aaaa Step:bb Step:c"], StepReward(separator=" Step:"), 512)
    offset = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert text.ids[offset:] == read.ids and text.positions == [offset + end for end in read.positions]
    # cut from the left: a step whose end is cut off is not read, the others keep their tokens
    first_end = text.positions[0]
    [cut] = read_texts(tokenizer, [prompt], ["aaaa Step:bb Step:c"], StepReward(separator=" Step:"),
                       len(text.ids) - first_end)  # keeps the first step's last token only
    assert cut.ids == text.ids[first_end:] and cut.positions == [0] + [p - first_end for p in text.positions[1:]]
    [cut] = read_texts(tokenizer, [prompt], ["aaaa Step:bb Step:c"], StepReward(separator=" Step:"),
                       len(text.ids) - first_end - 1)
    assert cut.ids == text.ids[first_end + 1:] and len(cut.positions) == 2
    assert [cut.ids[p] for p in cut.positions] == [text.ids[p] for p in text.positions[1:]]


def test_the_steps_scores_aggregate_as_their_papers_say():
    scores = torch.tensor([2.0, -1.0, 0.5])  # logits; the probabilities of being correct are their sigmoids
    correct = torch.sigmoid(scores)
    expected = {"min": correct[1], "product": correct.prod(), "last": correct[2]}
    assert set(STEP_AGGREGATIONS) == set(expected) == set(StepReward.model_fields["aggregation"].annotation.__args__)
    for name, value in expected.items():
        torch.testing.assert_close(reward_of(scores, StepReward(aggregation=name)), value)
    assert reward_of(scores, None) == scores[-1]  # an outcome model: its score at the text's end
    assert reward_of(torch.zeros(0), StepReward()) == 0  # no step left after the cut


def test_the_loss_is_each_step_s_cross_entropy_and_nothing_else():
    scores = torch.tensor([3.0, -2.0, 0.5], requires_grad=True)
    labels = torch.tensor([1.0, 0.0, 0.0])
    loss = process_reward_loss(scores, labels)
    manual = -(torch.log(torch.sigmoid(scores[0])) + torch.log(1 - torch.sigmoid(scores[1]))
               + torch.log(1 - torch.sigmoid(scores[2]))) / 3
    torch.testing.assert_close(loss, manual)
    assert step_accuracy(scores.detach(), labels).item() == pytest.approx(2 / 3)


def _solutions(count: int, seed: int, letter: str = "a") -> list[dict]:
    """Step-labelled records (TRL's stepwise supervision) over the prompts that ask for `letter`: 1-3 steps,
    each the letter repeated (correct) or another letter, alone or after it (wrong), half of them each."""
    rng = random.Random(seed)
    prompts = [r["prompt"] for r in toy_prompts(2048, seed=seed) if r["label"] == letter]
    others = [other for other in TOY_LETTERS if other != letter]
    records = []
    for prompt in prompts[:count]:
        steps, labels = [], []
        for _ in range(rng.randint(1, 3)):
            n, right = rng.choice((1, 2, 4)), rng.random() < 0.5
            other = rng.choice(others)
            steps.append(letter * n if right else rng.choice((other * n, letter * n + other * n)))
            labels.append(right)
        records.append({"prompt": prompt, "completions": steps, "labels": labels})
    return records


def test_step_labelled_records_put_each_label_where_its_step_ends(tiny_model, tmp_path, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    records = [{"prompt": "Say a.", "completions": ["aa", "b", "a"], "labels": [True, "-", 1]}]
    data = tmp_path / "steps.jsonl"
    data.write_text(json.dumps(records[0]) + "\n")
    spec = DatasetSpec(sources=[{"path": str(data)}], output_key="completions", label_key="labels")
    dataset = OfflineDataset.from_spec(spec, DataSpec(), tokenizer, response_keys=("completions",), base_dir=tmp_path,
                                       seed=0, name="sft", step_labelled=True)
    [example] = dataset.items
    solution = step_token_ids(tokenizer, ["aa", "b", "a"], "\n")
    assert example.responses == (solution.ids,)  # no eos: a process reward source reads no eos either
    assert example.step_labels == tuple(zip(solution.positions, (1.0, 0.0, 1.0)))
    batch = pack(dataset.items, tokenizer.pad_token_id)
    assert (batch.step_labels >= 0).sum() == 3 and batch.step_labels[0, solution.positions].tolist() == [1, 0, 1]

    with caplog.at_level("WARNING", logger="rlhf_trainer.offline_data"):  # a long prompt loses its beginning, with a warning
        [cut] = OfflineDataset.from_spec(spec, DataSpec(maxPromptTokens=8), tokenizer, response_keys=("completions",),
                                         base_dir=tmp_path, seed=0, name="sft", step_labelled=True).items
    assert cut.prompt_token_ids == example.prompt_token_ids[-8:] and cut.step_labels == example.step_labels
    assert "1 of 1 sft prompts were longer than data.maxPromptTokens=8" in caplog.text

    for record, error in (({**records[0], "labels": [True, False]}, r"3 steps \('completions'\) but 2 labels"),
                          ({**records[0], "labels": [True, "maybe", 1]}, "list of true/false, 1/0 or"),
                          ({**records[0], "completions": "aa\nb"}, "non-empty list of strings")):
        data.write_text(json.dumps(record) + "\n")
        with pytest.raises(ValueError, match=error):
            OfflineDataset.from_spec(spec, DataSpec(), tokenizer, response_keys=("completions",), base_dir=tmp_path,
                                     seed=0, name="sft", step_labelled=True)


def _held_out_step_accuracy(model_dir, records: list[dict]) -> float:
    scorer = RewardModelScorer(str(model_dir), device="cpu")
    return scorer.step_accuracy([render_prompt(r["prompt"], scorer.tokenizer, True) for r in records],
                                [r["completions"] for r in records], [r["labels"] for r in records])


# Measured (deterministic, 2026-11-27): held-out step accuracy 0.48 -> 0.91; GRPO's task reward 0.059 -> 0.721 in
# 10 steps (5-step means 0.09 -> 0.46) while the PRM's reward rose 0.36 -> 0.83. A PRM trained twice as long (or
# on wrong steps of random tokens too) was right on 0.98-1.0 of the held-out steps yet scored the untrained
# policy's byte noise at random, up to 0.98; GRPO then raised the PRM's reward (0.64 -> 0.91) and not the task's
# (0.06): reward hacking of a model outside its data, which the task reward that only watches shows.
PRM_STEPS, GRPO_STEPS, GRPO_GAIN = 32, 10, 0.15


def test_a_process_reward_model_learns_held_out_steps_and_grpo_learns_the_task_from_it(
        tiny_model, tiny_reward_model, toy_job, local_ray, tmp_path, capsys):
    """`rlhf run DIR`: stage 1 (prm) trains the tiny reward model on step-labelled solutions (a step is
    right when it repeats the letter the prompt asks for); its held-out step accuracy rises from the
    untrained model's. Stage 2 (GRPO) loads it as spec.models.reward (fromJob) and its only reward that
    counts is that model read step by step (steps: min over the steps split at the newline); the task's own
    reward, weighted 1e-6 so that it only watches, rises."""
    stages = tmp_path / "pipeline"
    (stages / "data").mkdir(parents=True)
    (stages / "data" / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _solutions(256, seed=4)))
    prm = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "letters-prm"}, "spec": {
        "algorithm": "prm",
        "models": {"actor": {"path": str(tiny_reward_model), "dtype": "float32"}},
        "data": {"sft": {"sources": [{"path": "data/steps.jsonl"}], "outputKey": "completions", "labelKey": "labels"},
                 "maxPromptTokens": 48, "maxTokens": 80},
        "training": {"zeroStage": 2, "bf16": False, "learningRate": 1.0e-3, "lrWarmupRatio": 0.0, "epochs": 2,
                     "lrScheduler": "constant", "trainBatchSize": 16, "microTrainBatchSize": 8, "seed": 42,
                     "maxSteps": PRM_STEPS},
        "resources": {"nodes": 1, "gpusPerNode": 0},
        "checkpoint": {"path": "checkpoints", "intervalSteps": 0, "exportHf": True}}}
    grpo = yaml.safe_load(toy_job(**{"training.maxSteps": GRPO_STEPS, "training.episodes": 3,
                                     "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                                     "models.reward": {"fromJob": {"name": "letters-prm"}, "dtype": "float32"}}
                                  ).read_text())
    grpo["metadata"]["name"] = "letters-grpo"
    letter = grpo["spec"]["reward"]["sources"][0]
    grpo["spec"]["reward"]["sources"] = [{"name": "prm", "type": "model", "steps": {"aggregation": "min"}},
                                         {**letter, "weight": 1e-6}]
    shutil.copytree(tmp_path / "tiny", stages / "tiny")
    asked, _ = one_letter_task("a")
    (stages / "tiny" / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in asked))
    for name, stage in (("1-prm.yaml", prm), ("2-grpo.yaml", grpo)):
        (stages / name).write_text(yaml.safe_dump(stage))

    assert run_pipeline([stages], output_dir=tmp_path / "out") == 0

    def metrics(stage: str) -> list[dict]:
        logs = tmp_path / "out" / stage / "checkpoints" / "logs" / "metrics.jsonl"
        return [json.loads(line) for line in logs.read_text().splitlines()]

    held_out = _solutions(48, seed=9)
    accuracy = {"before": _held_out_step_accuracy(tiny_reward_model, held_out),
                "after": _held_out_step_accuracy(tmp_path / "out" / "letters-prm" / "checkpoints" / "final", held_out)}
    training = [round(m["step_accuracy"], 2) for m in metrics("letters-prm")]
    task = [m[f"reward/{letter['name']}"] for m in metrics("letters-grpo")]
    with capsys.disabled():
        print(f"\nprm: held-out step accuracy {accuracy}, training step accuracy {training}; grpo against it: task "
              f"reward per step {[round(r, 3) for r in task]}, the prm's "
              f"{[round(m['reward/prm'], 3) for m in metrics('letters-grpo')]}")
    assert len(training) == PRM_STEPS and len(task) == GRPO_STEPS
    exported = json.loads((tmp_path / "out" / "letters-prm" / "checkpoints" / "final" / "config.json").read_text())
    assert exported["step_separator"] == "\n"  # what checks.py holds a reading source to
    assert accuracy["after"] >= 0.8 and accuracy["after"] > accuracy["before"] + 0.2, accuracy
    assert sum(task[-5:]) / 5 > sum(task[:5]) / 5 + GRPO_GAIN, task
