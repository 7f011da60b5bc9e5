"""Writes train.jsonl and eval.jsonl: single-digit additions, the held-out set's pairs never in training;
and train-pairs.jsonl and eval-pairs.jsonl, the same prompts as preference pairs (dpo): chosen the sum
as the equation the base model writes ("7 + 5 = 12"), rejected the equation off by one, half of them
after a rambling sentence (the base model's two failures: a near miss, and a preamble that runs past
maxNewTokens). A bare-number chosen taught brevity instead of sums: the held-out score fell.
train-scored.jsonl (csft): each training pair's two answers as records of mixed quality, the right one scored
5 and the wrong one 1.
train-steps.jsonl and eval-steps.jsonl (prm): solutions in steps (a step a line), each step labelled whether
it leads to the sum, as Math-Shepherd labels steps by the answer they reach. Three written a prompt: one that
reaches the sum (an equation or a bare number, alone or after the preamble's sentence), one that reaches a
wrong sum, and the preamble cut off before any sum (the base model's answer that runs past maxNewTokens); and
four sampled from the base model as the GRPO example samples, each step labelled by the answer's reward.py
score (one rollout's estimate: a PRM must judge what the policy it rewards writes).

    python manifests/examples/arithmetic/make_data.py [--model manifests/examples/smollm2/model]
    # deterministic; the files are checked in; the *-steps files are written only with --model
"""

import argparse
import json
import random
import re
from pathlib import Path

from reward import correct

TEMPLATES = (
    "What is {a} + {b}? Answer with just the number.",
    "Compute {a} + {b}. Reply with the number only.",
    "{a} + {b} = ? Give only the result.",
    "Add {a} and {b}. Answer with a single number.",
)
EQUATION = "{a} + {b} = {sum}"
RAMBLING = "To find the sum of {a} and {b}, we add the two numbers together. Adding them gives {a} + {b} = {wrong}."


def records(pairs, templates):
    return [{"prompt": t.format(a=a, b=b), "label": str(a + b)} for a, b in pairs for t in templates]


def preference_pairs(rows, rng):
    """Each record as a pair: chosen the equation with its sum, rejected with a sum off by one (bare or after a preamble)."""
    pairs = []
    for row in rows:
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        wrong = a + b + rng.choice((-1, 1))
        rejected = rng.choice((EQUATION.format(a=a, b=b, sum=wrong), RAMBLING.format(a=a, b=b, wrong=wrong)))
        pairs.append({"prompt": row["prompt"], "chosen": EQUATION.format(a=a, b=b, sum=a + b), "rejected": rejected})
    return pairs


def scored(pairs):
    """Each pair as two prompt/response records with a quality score: chosen 5, rejected 1."""
    return [{"prompt": pair["prompt"], "response": pair[side], "score": score}
            for pair in pairs for side, score in (("chosen", 5), ("rejected", 1))]


def step_labelled(rows, rng, sampled: list[list[str]]):
    """Each prompt's written solutions and its sampled ones (TRL's stepwise form: completions and labels)."""
    records = []
    for row, completions in zip(rows, sampled):
        for completion in completions:
            steps = [step for step in completion.split("\n") if step.strip()] or [completion]
            records.append({"prompt": row["prompt"], "completions": steps,
                            "labels": [bool(correct(completion, row["label"]))] * len(steps), "sampled": True})
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        preamble = RAMBLING.split(" Adding")[0].format(a=a, b=b)
        for answer in (a + b, a + b + rng.choice((-2, -1, 1, 2))):
            steps = [rng.choice((EQUATION.format(a=a, b=b, sum=answer), str(answer)))]
            if rng.random() < 0.5:
                steps.insert(0, preamble)
            records.append({"prompt": row["prompt"], "completions": steps,
                            "labels": [True] * (len(steps) - 1) + [answer == a + b]})
        words = preamble.split()
        records.append({"prompt": row["prompt"], "completions": [" ".join(words[:rng.randrange(3, len(words))])],
                        "labels": [False]})
    return records


def base_model_samples(rows, model_dir: str, samples=4, chunk=32) -> list[list[str]]:
    """`samples` completions of each row's prompt by the model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evaluate import sample

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions = []
    for start in range(0, len(rows), chunk):
        flat = sample(model, tokenizer, [row["prompt"] for row in rows[start:start + chunk]], samples, seed=start)
        completions += [flat[i:i + samples] for i in range(0, len(flat), samples)]
    return completions


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the base model whose samples the *-steps files include")
    model = parser.parse_args().model
    rng = random.Random(0)
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    rng.shuffle(pairs)
    held_out, train = pairs[:16], pairs[16:]
    here = Path(__file__).parent
    for name, rows in (("train", records(train, TEMPLATES)), ("eval", records(held_out, TEMPLATES))):
        rng.shuffle(rows)
        write(here / f"{name}.jsonl", rows)
        pairs = preference_pairs(rows, random.Random(name))
        write(here / f"{name}-pairs.jsonl", pairs)
        if name == "train":
            write(here / "train-scored.jsonl", scored(pairs))
        if model:
            write(here / f"{name}-steps.jsonl",
                  step_labelled(rows, random.Random(f"{name}-steps"), base_model_samples(rows, model)))
