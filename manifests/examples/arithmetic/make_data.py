"""Writes train.jsonl and eval.jsonl: single-digit additions, the held-out set's pairs never in training.

    python manifests/examples/arithmetic/make_data.py   # deterministic; the files are checked in
"""

import json
import random
from pathlib import Path

TEMPLATES = (
    "What is {a} + {b}? Answer with just the number.",
    "Compute {a} + {b}. Reply with the number only.",
    "{a} + {b} = ? Give only the result.",
    "Add {a} and {b}. Answer with a single number.",
)


def records(pairs, templates):
    return [{"prompt": t.format(a=a, b=b), "label": str(a + b)} for a, b in pairs for t in templates]


if __name__ == "__main__":
    rng = random.Random(0)
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    rng.shuffle(pairs)
    held_out, train = pairs[:16], pairs[16:]
    here = Path(__file__).parent
    for name, rows in (("train", records(train, TEMPLATES)), ("eval", records(held_out, TEMPLATES))):
        rng.shuffle(rows)
        (here / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
