"""The machine's limit for a GRPO step: the step's matmul FLOPs over the matmul throughput of all cores.

    PYTHONPATH=operator:trainer_image .venv/bin/python benchmarks/flop_limit.py \
        [--results benchmarks/results/grpo_cpu_vs_trl_smollm2_bf16.json]   # ~1 minute; results/flop_limit.json

Throughput: torch's matmul of two 2048 x 2048 matrices on all cores (torch's default threads), float32 and
bfloat16, the median of 20 after 3 warm-up calls. The step's FLOPs come from the SmolLM2 example
(manifests/examples/smollm2-grpo-cpu-job.yaml) and the model's shape: a forward pass costs 2 FLOPs per
matmul weight per token (the output head included, the embedding lookup not; attention's own products are
under 2% at these lengths and left out), a backward pass twice the forward. A step of ours runs the
reference's forward, the update's forward and backward (pi_old from that forward:
trainer.actor_scored_in_update) and generation, one forward per token with the KV cache: 5 forwards' worth
of every token. The tokens per step are the example's prompts (with the chat template) and the mean
response length `--results` measured (the benchmark's generated tokens per step), or `--response-tokens`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import ARITHMETIC, EXAMPLES, RESULTS, cpu_model, git_commit, load_job  # noqa: E402

FORWARDS_PER_STEP = 5  # the reference's forward, the update's forward + backward (x3), generation


def matmul_gflops(dtype, size: int = 2048, calls: int = 20) -> float:
    import torch

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    seconds = []
    for _ in range(calls):
        started = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(seconds) / 1e9


def matmul_weights(model_dir: Path) -> int:
    """Weights a token's forward multiplies by: every linear layer's and the output head's."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def step_tokens(model_dir: Path, response_tokens: float) -> tuple[float, int]:
    """(tokens of a step's samples, samples per step) of the SmolLM2 example."""
    from transformers import AutoTokenizer

    spec = load_job(1, ARITHMETIC)["spec"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = [json.loads(line) for line in (EXAMPLES / ARITHMETIC.files / ARITHMETIC.prompts).read_text().splitlines()]
    prompts = [len(tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                           add_generation_prompt=True)).input_ids) for r in records]
    samples = spec["training"]["rolloutBatchSize"] * spec["rollout"]["samplesPerPrompt"]
    return samples * (statistics.mean(prompts) + response_tokens), samples


def main() -> None:
    import torch
    from rlhf_trainer.pretrained import build_smollm2

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="a grpo_cpu_vs_trl.py --model-shape smollm2 result: its "
                        "generated tokens per step and step times")
    parser.add_argument("--response-tokens", type=float, default=16.0, help="mean response length without --results")
    parser.add_argument("--model", type=Path, default=Path("/tmp/flop-limit-smollm2"))
    parser.add_argument("--out", type=Path, default=RESULTS / "flop_limit.json")
    args = parser.parse_args()

    model_dir = args.model if (args.model / "config.json").exists() else build_smollm2(args.model)
    measured = json.loads(args.results.read_text()) if args.results else None
    response = args.response_tokens
    if measured:
        workload = measured["workload"]
        samples = workload["prompts_per_step"] * workload["samples_per_prompt"]
        response = measured["summary"]["generated_tokens_per_step_median"]["ours"] / samples
    tokens, samples = step_tokens(model_dir, response)
    weights = matmul_weights(model_dir)
    flops = 2 * weights * tokens * FORWARDS_PER_STEP
    rates = {name: matmul_gflops(getattr(torch, name)) for name in ("float32", "bfloat16")}
    result = {
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "commit": git_commit(),
        "matmul_weights": weights, "samples_per_step": samples, "tokens_per_step": tokens,
        "response_tokens": response, "step_tflop": flops / 1e12,
        "matmul_gflops": rates,
        "limit_seconds": {name: flops / (rate * 1e9) for name, rate in rates.items()},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
