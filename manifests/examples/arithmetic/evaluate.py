"""Scores a model trained offline on the arithmetic task against the model it started from, on the held-out set:

- preference accuracy: the share of eval-pairs.jsonl where DPO's implicit reward (beta times the log-prob
  ratio to the base model) ranks chosen above rejected, and its mean margin; and, defined before training
  too, the share where the model's own summed log-prob does;
- task score: the mean reward.py score of `samples` completions per eval.jsonl prompt, sampled as the
  GRPO example's evaluation samples (temperature 0.7, 32 new tokens, ending at the end-of-turn token);
- with --prm, of process reward models (prm's exports): the held-out step accuracy on eval-steps.jsonl's written
  solutions and on the base model's sampled ones, beside always answering the commoner label.

    python manifests/examples/arithmetic/evaluate.py BASE_MODEL [TRAINED_MODEL] [--beta 0.1] [--score 5]
    python manifests/examples/arithmetic/evaluate.py --prm PRM [PRM]
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_api.v1alpha1 import DataSpec, DatasetSpec
from rlhf_trainer.data import conditioned, render_prompt
from rlhf_trainer.losses import masked_sum, token_log_probs
from rlhf_trainer.offline_data import OfflineDataset, pack
from rlhf_trainer.rewards import RewardModelScorer
from rlhf_trainer.workers.engine import position_ids

from reward import score

HERE = Path(__file__).parent


@torch.no_grad()
def pair_logps(model, tokenizer) -> torch.Tensor:
    """Summed log-probs of chosen and rejected of every held-out pair [pairs, 2], tokenized as dpo trains them."""
    dataset = OfflineDataset.from_spec(DatasetSpec(sources=[{"path": "eval-pairs.jsonl"}]), DataSpec(), tokenizer,
                                       response_keys=("chosen", "rejected"), base_dir=HERE, seed=0, name="eval")
    batch = pack(dataset.items, tokenizer.pad_token_id)
    logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask,
                   position_ids=position_ids(batch.attention_mask)).logits[:, -batch.num_actions - 1:-1]
    logps = masked_sum(token_log_probs(logits, batch.sequences[:, -batch.num_actions:]), batch.action_mask, dim=-1)
    return logps.view(2, len(dataset)).T  # response-major rows


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], samples: int, seed: int) -> list[str]:
    """`samples` completions of each prompt (prompt-major), sampled as the GRPO example's rollouts are."""
    rendered = [render_prompt(prompt, tokenizer, apply_chat_template=True) for prompt in prompts]
    tokenizer.padding_side = "left"  # every prompt's generation starts at the same position
    inputs = tokenizer(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(**inputs, do_sample=True, temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=32,
                         num_return_sequences=samples, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def task_score(model, tokenizer, samples: int, seed: int, score_asked: float | None = None) -> float:
    records = [json.loads(line) for line in (HERE / "eval.jsonl").read_text().splitlines()]
    asked = [r["prompt"] if score_asked is None else conditioned(r["prompt"], score_asked, DataSpec().score_template)
             for r in records]
    completions = sample(model, tokenizer, asked, samples, seed)
    rewards = score([r["prompt"] for r in records for _ in range(samples)], completions,
                    [r["label"] for r in records for _ in range(samples)])
    return sum(rewards) / len(rewards)


def step_accuracies(model: str) -> dict[str, float]:
    records = [json.loads(line) for line in (HERE / "eval-steps.jsonl").read_text().splitlines()]
    scorer = RewardModelScorer(model, device="cpu")
    accuracies = {}
    for name, sampled in (("written", False), ("sampled", True)):
        chosen = [r for r in records if r.get("sampled", False) == sampled]
        labels = [label for r in chosen for label in r["labels"]]
        accuracies[f"step_accuracy_{name}"] = scorer.step_accuracy(
            [render_prompt(r["prompt"], scorer.tokenizer, True) for r in chosen], [r["completions"] for r in chosen],
            [r["labels"] for r in chosen])
        accuracies[f"commoner_label_{name}"] = max(labels.count(True), labels.count(False)) / len(labels)
    return accuracies


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("trained", nargs="?")
    parser.add_argument("--beta", type=float, default=0.1, help="training.preference.beta of the run")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--score", type=float, default=None,
                        help="csft: ask for this score through data.scoreTemplate's default (the trained model only)")
    parser.add_argument("--prm", action="store_true", help="the models are process reward models")
    args = parser.parse_args()
    if args.prm:
        for name in filter(None, (args.base, args.trained)):
            print(json.dumps({"model": name, **step_accuracies(name)}), flush=True)
        return
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    reference = None
    for name in filter(None, (args.base, args.trained)):
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
        logps = pair_logps(model, tokenizer)
        reference = logps if reference is None else reference
        margin = args.beta * ((logps - reference) @ torch.tensor([1.0, -1.0]))
        print(json.dumps({
            "model": name,
            "preference_accuracy": (margin > 0).float().mean().item(),
            "preference_margin": margin.mean().item(),
            "logprob_preference_accuracy": (logps[:, 0] > logps[:, 1]).float().mean().item(),
            "task_score": task_score(model, tokenizer, args.samples, args.seed,
                                     args.score if name == args.trained else None),
        }), flush=True)


if __name__ == "__main__":
    main()
