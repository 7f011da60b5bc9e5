"""The GRPO update alone: our policy step in its DeepSpeed engine against a plain torch loop, same micro-batches.

    PYTHONPATH=operator:trainer_image .venv/bin/python benchmarks/update_profile.py   # ~3 minutes on 2 cores;
                                                                                     # results/update_profile.json

The workload is one optimizer step of the SmolLM2 GRPO example (manifests/examples/smollm2-grpo-cpu-job.yaml:
64 samples, micro-batches of 8, its precision: float32 weights under bf16 autocast), on random token ids of the
example's lengths (43 prompt tokens, 18 response tokens) with random advantages. "ours" is what an actor rank
runs: workers/objectives.policy_step (the update's own forward as pi_old, the k3 KL to given reference
log-probs in the loss, token-mean over the step) on the model workers/engine.load_model builds (DeepSpeed
ZeRO-2, torch's fused AdamW). "plain" is the loop TRL's GRPO runs: the same model in float32 under
torch.autocast, the same loss by hand, backward on each micro-batch, AdamW (fused) at the end. Both run on all
cores (torch's default threads), one after the other, --steps optimizer steps each after one warm-up; the
medians, and the ten operators with the most time of one step of each (torch.profiler, self CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import ARITHMETIC, RESULTS, cpu_model, git_commit, load_job  # noqa: E402

PROMPT, RESPONSE = 43, 18  # the example's mean prompt (chat template included) and response tokens


def batches(vocab: int, samples: int, micro: int, seed: int = 0):
    """`samples` rows of PROMPT + RESPONSE random tokens in micro-batches: (sequences, advantages, reference log-probs)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples // micro):
        sequences = torch.randint(3, vocab, (micro, PROMPT + RESPONSE), generator=generator)
        rows.append((sequences, torch.randn(micro, RESPONSE, generator=generator),
                     -torch.rand(micro, RESPONSE, generator=generator) * 3))
    return rows


def ours(model_dir: Path, spec, micro_batches: list, steps: int) -> tuple[list[float], object]:
    import torch
    from rlhf_trainer.experience import Experience
    from rlhf_trainer.workers.distributed import COLLECTIVE_TIMEOUT, init_distributed, open_store
    from rlhf_trainer.workers.engine import ModelConfig, load_model
    from rlhf_trainer.workers.objectives import policy_step

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init_distributed(0, 1, open_store(1, COLLECTIVE_TIMEOUT), use_gpu=False)
    model = load_model(ModelConfig(role="actor", path=str(model_dir), model=spec.models.actor, training=spec.training,
                                   optimizer_steps=steps + 1, max_new_tokens=spec.rollout.max_new_tokens,
                                   algorithm=spec.algorithm), 0, 1)
    tokens = torch.tensor(float(len(micro_batches) * micro_batches[0][0].shape[0] * RESPONSE))
    experiences = [Experience(sequences=s, attention_mask=torch.ones_like(s),
                              action_mask=torch.ones(s.shape[0], RESPONSE, dtype=torch.bool), advantages=a,
                              base_action_log_probs=r, step_tokens=tokens.expand(s.shape[0]).clone())
                   for s, a, r in micro_batches]

    def step():
        for experience in experiences:
            policy_step(model, experience)

    return timed(step, steps), profiled(step)


def plain(model_dir: Path, spec, micro_batches: list, steps: int) -> tuple[list[float], object]:
    import torch
    from transformers import AutoModelForCausalLM

    training = spec.training
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=training.weight_decay, fused=True)
    tokens = len(micro_batches) * micro_batches[0][0].shape[0] * RESPONSE
    beta = training.kl.coef

    def step():
        for sequences, advantages, reference in micro_batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=training.bf16):
                logits = model(input_ids=sequences, logits_to_keep=RESPONSE + 1).logits[:, :-1]
            log_probs = logits.float().log_softmax(-1).gather(-1, sequences[:, -RESPONSE:, None])[..., 0]
            ratio = (log_probs - log_probs.detach()).exp()  # pi_old from this forward, as TRL's num_iterations=1
            kl = (reference - log_probs).exp() - (reference - log_probs) - 1  # k3
            (((-advantages * ratio) + beta * kl).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, steps), profiled(step)


def timed(step, steps: int) -> list[float]:
    step()  # warm-up
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return seconds


def profiled(step) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        step()
    top = sorted(recorded.key_averages(), key=lambda event: event.self_cpu_time_total, reverse=True)[:10]
    return [{"op": event.key, "self_seconds": event.self_cpu_time_total / 1e6, "calls": event.count} for event in top]


def main() -> None:
    import torch
    from rlhf_api.validation import validate
    from rlhf_trainer.pretrained import build_smollm2
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="ours at this ZeRO stage (default: the example's)")
    parser.add_argument("--model", type=Path, default=Path("/tmp/update-profile-smollm2"))
    parser.add_argument("--out", type=Path, default=RESULTS / "update_profile.json")
    args = parser.parse_args()

    model_dir = args.model if (args.model / "config.json").exists() else build_smollm2(args.model)
    job = load_job(args.steps, ARITHMETIC)
    job["spec"]["models"]["actor"]["path"] = str(model_dir)
    if args.zero_stage is not None:
        job["spec"]["training"]["zeroStage"] = args.zero_stage
    spec = validate(job).spec
    micro_batches = batches(AutoConfig.from_pretrained(model_dir).vocab_size,
                            spec.training.train_batch_size, spec.training.micro_train_batch_size)
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "commit": git_commit(),
              "workload": {"samples": spec.training.train_batch_size, "micro_batch": spec.training.micro_train_batch_size,
                           "prompt_tokens": PROMPT, "response_tokens": RESPONSE, "bf16": spec.training.bf16,
                           "dtype": spec.models.actor.dtype, "zero_stage": spec.training.zero_stage}}
    for name, side in (("plain", plain), ("ours", ours)):
        seconds, top = side(model_dir, spec, micro_batches, args.steps)
        result[name] = {"step_seconds": seconds, "median": statistics.median(seconds), "top_ops": top}
        print(f"{name}: optimizer step {statistics.median(seconds):.2f} s (median of {seconds})")
        for op in top:
            print(f"    {op['self_seconds']:7.2f} s  {op['calls']:6d} calls  {op['op']}")
    result["ours_over_plain"] = result["ours"]["median"] / result["plain"]["median"]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"ours / plain: {result['ours_over_plain']:.2f}; figures in {args.out}")


if __name__ == "__main__":
    main()
