"""Sample packing vs padding: training tokens/s of the trainer's forward + backward pass
(Model.action_logits, the path policy_step, sft_step and preference_step take) on micro-batches
of mixed lengths, training.packSamples true vs false, side by side in one process.

Each repeat times both sides on the same micro-batches, one micro-batch at a time, back to back,
alternating which goes first; tokens/s counts the real (unpadded) tokens, the same for both sides.
Writes the median over repeats of each side's time, their ratio, and the median of the
micro-batch pairs' ratios (steadier on a shared, loaded machine) as JSON.

    .venv/bin/python benchmarks/packing.py [--repeats 7] [--out benchmarks/results/packing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec  # noqa: E402
from rlhf_trainer.losses import masked_sum, token_log_probs  # noqa: E402
from rlhf_trainer.tiny import build_tiny_model  # noqa: E402
from rlhf_trainer.workers.engine import Model, ModelConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "trainer"))
from test_packing import mixed_batch  # noqa: E402  the layout the trainer's batches have

MICRO_BATCH, ACTIONS, MICRO_BATCHES = 16, 64, 4


def shapes(seed: int) -> list[tuple[int, int]]:
    """(prompt, response) lengths of a micro-batch: prompts 8-128 tokens, responses 4-64, uniform."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(8, 129, (MICRO_BATCH,), generator=generator)
    responses = torch.randint(4, ACTIONS + 1, (MICRO_BATCH,), generator=generator)
    return list(zip(prompts.tolist(), responses.tolist()))


def side(model_dir: Path, packed: bool) -> Model:
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = ModelConfig(role="actor", path=str(model_dir), model=ModelSpec(path=str(model_dir), dtype="float32"),
                      training=TrainingSpec(pack_samples=packed))
    return Model(cfg, 0, module, tokenizer=None, zero3=False)


def train_pass(model: Model, batch) -> float:
    """Seconds for forward + backward of one micro-batch."""
    sequences, attention_mask, action_mask = batch
    started = time.perf_counter()
    log_probs = token_log_probs(model.action_logits(sequences, attention_mask, ACTIONS), sequences[:, -ACTIONS:])
    masked_sum(log_probs, action_mask).backward()
    elapsed = time.perf_counter() - started
    model.engine.zero_grad(set_to_none=True)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "packing.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        model_dir = build_tiny_model(Path(directory) / "model")
        sides = {"padded": side(model_dir, packed=False), "packed": side(model_dir, packed=True)}
        vocab = sides["padded"].engine.config.vocab_size
        batches = [mixed_batch(vocab, shapes(seed), ACTIONS, seed) for seed in range(MICRO_BATCHES)]
        tokens = sum(int(mask.sum()) for _, mask, _ in batches)
        padded_tokens = sum(mask.numel() for _, mask, _ in batches)
        for model in sides.values():
            train_pass(model, batches[0])  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in sides}  # per repeat: all micro-batches
        pair_ratios = []  # padded / packed seconds of one micro-batch, run back to back
        load_start = os.getloadavg()
        for repeat in range(args.repeats):
            totals = dict.fromkeys(sides, 0.0)
            for i, batch in enumerate(batches):
                order = list(sides) if (repeat + i) % 2 == 0 else list(reversed(sides))
                pair = {name: train_pass(sides[name], batch) for name in order}
                pair_ratios.append(pair["padded"] / pair["packed"])
                for name, elapsed in pair.items():
                    totals[name] += elapsed
            for name, total in totals.items():
                seconds[name].append(total)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "command": "python benchmarks/packing.py " + " ".join(sys.argv[1:]),
        "workload": f"tiny Qwen2 (rlhf tiny-model), float32, {MICRO_BATCHES} micro-batches of {MICRO_BATCH} samples, "
                    f"prompts 8-128 and responses 4-{ACTIONS} tokens, forward + backward of Model.action_logits",
        "real_tokens": tokens, "padded_tokens": padded_tokens,
        "seconds": seconds, "median_seconds": medians,
        "tokens_per_second": {name: tokens / median for name, median in medians.items()},
        "packed_speedup": medians["padded"] / medians["packed"],
        "packed_speedup_pairwise_median": statistics.median(pair_ratios),
        "pair_ratios": pair_ratios,
        "torch_threads": torch.get_num_threads(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    shown = ("real_tokens", "padded_tokens", "tokens_per_second", "packed_speedup", "packed_speedup_pairwise_median")
    print(json.dumps({k: result[k] for k in shown}, indent=2))


if __name__ == "__main__":
    main()
