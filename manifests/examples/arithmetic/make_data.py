"""Writes train.jsonl and eval.jsonl: single-digit additions, the held-out set's pairs never in training;
and train-pairs.jsonl and eval-pairs.jsonl, the same prompts as preference pairs (dpo): chosen the sum
as the equation the base model writes ("7 + 5 = 12"), rejected the equation off by one, half of them
after a rambling sentence (the base model's two failures: a near miss, and a preamble that runs past
maxNewTokens). A bare-number chosen taught brevity instead of sums: the held-out score fell.
train-scored.jsonl (csft): each training pair's two answers as records of mixed quality, the right one scored
5 and the wrong one 1.

    python manifests/examples/arithmetic/make_data.py   # deterministic; the files are checked in
"""

import json
import random
import re
from pathlib import Path

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


def write(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
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
