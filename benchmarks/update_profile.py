"""The GRPO update alone: our policy step in its DeepSpeed engine against a plain torch loop, same micro-batches.

    PYTHONPATH=operator:trainer_image .venv/bin/python benchmarks/update_profile.py   # ~3 minutes on 2 cores;
                                                                                     # results/update_profile.json

The workload is one optimizer step of the SmolLM2 GRPO example (manifests/examples/smollm2-grpo-cpu-job.yaml:
64 samples, micro-batches of 8, its precision: float32 weights under bf16 autocast, its attention), on random
token ids with random advantages: every row of the example's mean lengths (43 prompt tokens, 18 response
tokens), or --lengths ragged, spread as its rollouts are, cut into micro-batches as the trainer cuts them
(--split shuffled: rows in random order, as before the trainer put like lengths together). "ours" is what an
actor rank runs: workers/objectives.policy_step (the update's own forward as pi_old, the k3 KL to given
reference log-probs in the loss, token-mean over the step) on the model workers/engine.load_model builds
(DeepSpeed at the example's ZeRO stage, torch's fused AdamW, samples packed). "plain" is the loop TRL's GRPO
runs: the same model in float32 under torch.autocast, the same loss by hand on the padded rows, backward on
each micro-batch, AdamW (fused) at the end. Both run on all cores (torch's default threads), one after the
other, --steps optimizer steps each after one warm-up; the medians, and the ten operators with the most time
of one step of each (torch.profiler, self CPU time).

    PYTHONPATH=operator:trainer_image .venv/bin/python benchmarks/update_profile.py --lengths ragged \
        --split shuffled --attention sdpa --out /tmp/before.json        # the example's update before issue 34's last changes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import ARITHMETIC, RESULTS, cpu_model, git_commit, load_job  # noqa: E402

PROMPT, RESPONSE = 43, 18  # the example's mean prompt (chat template included) and response tokens
MAX_NEW_TOKENS = 32  # the example's rollout.maxNewTokens


def experience(vocab: int, samples: int, ragged: bool, seed: int = 0):
    """One optimizer step's rows of random token ids, laid out as the trainer lays them out (prompts left-padded,
    responses right-padded), with random advantages and reference log-probs. Fixed: every row PROMPT + RESPONSE
    tokens. Ragged, spread as the example's rollouts are: prompts of 40-46 tokens, a third of the responses cut
    at maxNewTokens, the others of 5-19 tokens (a mean of about RESPONSE)."""
    import torch
    from rlhf_trainer.experience import Experience

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(40, 47, (samples,), generator=generator) if ragged else torch.full((samples,), PROMPT)
    responses = (torch.where(torch.rand(samples, generator=generator) < 0.35, MAX_NEW_TOKENS,
                             torch.randint(5, 20, (samples,), generator=generator))
                 if ragged else torch.full((samples,), RESPONSE))
    width_p, width_r = int(prompts.max()), int(responses.max())
    prompt_mask = torch.arange(width_p) >= width_p - prompts[:, None]
    action_mask = torch.arange(width_r) < responses[:, None]
    attention_mask = torch.cat([prompt_mask, action_mask], 1)
    return Experience(sequences=torch.randint(3, vocab, attention_mask.shape, generator=generator) * attention_mask,
                      attention_mask=attention_mask.long(), action_mask=action_mask,
                      advantages=torch.randn(samples, width_r, generator=generator),
                      base_action_log_probs=-torch.rand(samples, width_r, generator=generator) * 3)


def micro_batches(step, micro: int, split: str) -> list:
    """The step's micro-batches as an actor rank gets them: the trainer's split (workers/group.py: rows of like
    lengths together), or `shuffled`, the split before it (rows in random order)."""
    import torch
    from rlhf_trainer.workers.group import micro_batches_per_rank

    generator = torch.Generator().manual_seed(0)
    if split == "shuffled":
        tokens = step.action_mask.sum()
        shuffled = step.select(torch.randperm(step.batch_size, generator=generator))
        return replace(shuffled, step_tokens=tokens.expand(step.batch_size).clone()).split(micro)
    return micro_batches_per_rank(step, 1, train_batch_size=step.batch_size, micro_batch_size=micro, epochs=1,
                                  generator=generator)[0]


def ours(model_dir: Path, spec, batches: list, steps: int) -> tuple[list[float], object]:
    from rlhf_trainer.workers.distributed import COLLECTIVE_TIMEOUT, init_distributed, open_store
    from rlhf_trainer.workers.engine import ModelConfig, load_model
    from rlhf_trainer.workers.objectives import policy_step

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    init_distributed(0, 1, open_store(1, COLLECTIVE_TIMEOUT), use_gpu=False)
    model = load_model(ModelConfig(role="actor", path=str(model_dir), model=spec.models.actor, training=spec.training,
                                   optimizer_steps=steps + 1, max_new_tokens=spec.rollout.max_new_tokens,
                                   algorithm=spec.algorithm), 0, 1)

    def step():
        for batch in batches:
            policy_step(model, batch)

    return timed(step, steps), profiled(step)


def plain(model_dir: Path, spec, batches: list, steps: int) -> tuple[list[float], object]:
    import torch
    from transformers import AutoModelForCausalLM

    training = spec.training
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=spec.models.actor.attn_implementation)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=training.weight_decay, fused=True)
    beta = training.kl.coef

    def step():
        for batch in batches:  # padded rows, as TRL feeds them
            width, mask = batch.num_actions, batch.action_mask
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=training.bf16):
                logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask,
                               logits_to_keep=width + 1).logits[:, :-1]
            log_probs = logits.float().log_softmax(-1).gather(-1, batch.sequences[:, -width:, None])[..., 0]
            ratio = (log_probs - log_probs.detach()).exp()  # pi_old from this forward, as TRL's num_iterations=1
            reference = batch.base_action_log_probs
            kl = (reference - log_probs).exp() - (reference - log_probs) - 1  # k3
            ((((-batch.advantages * ratio) + beta * kl) * mask).sum() / batch.step_tokens[0]).backward()
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
    parser.add_argument("--lengths", choices=["fixed", "ragged"], default="fixed",
                        help="every row of the mean lengths, or lengths spread as the example's rollouts (default fixed)")
    parser.add_argument("--split", choices=["trainer", "shuffled"], default="trainer",
                        help="micro-batches as the trainer cuts them (rows of like lengths), or rows in random order")
    parser.add_argument("--attention", choices=["sdpa", "eager"], help="both sides' attention (default: the example's)")
    parser.add_argument("--model", type=Path, default=Path("/tmp/update-profile-smollm2"))
    parser.add_argument("--out", type=Path, default=RESULTS / "update_profile.json")
    args = parser.parse_args()

    model_dir = args.model if (args.model / "config.json").exists() else build_smollm2(args.model)
    job = load_job(args.steps, ARITHMETIC)
    job["spec"]["models"]["actor"]["path"] = str(model_dir)
    if args.zero_stage is not None:
        job["spec"]["training"]["zeroStage"] = args.zero_stage
    if args.attention:
        job["spec"]["models"]["actor"]["attnImplementation"] = args.attention
    spec = validate(job).spec
    step = experience(AutoConfig.from_pretrained(model_dir).vocab_size, spec.training.train_batch_size,
                      args.lengths == "ragged")
    batches = micro_batches(step, spec.training.micro_train_batch_size, args.split)
    result = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "commit": git_commit(),
              "workload": {"samples": spec.training.train_batch_size, "micro_batch": spec.training.micro_train_batch_size,
                           "lengths": args.lengths, "split": args.split,
                           "tokens": int(step.attention_mask.sum()), "response_tokens": int(step.action_mask.sum()),
                           "attention": spec.models.actor.attn_implementation, "bf16": spec.training.bf16,
                           "dtype": spec.models.actor.dtype, "zero_stage": spec.training.zero_stage}}
    for name, side in (("plain", plain), ("ours", ours)):
        seconds, top = side(model_dir, spec, batches, args.steps)
        result[name] = {"step_seconds": seconds, "median": statistics.median(seconds), "top_ops": top}
        print(f"{name}: optimizer step {statistics.median(seconds):.2f} s (median of {seconds})")
        for op in top:
            print(f"    {op['self_seconds']:7.2f} s  {op['calls']:6d} calls  {op['op']}")
    result["ours_over_plain"] = result["ours"]["median"] / result["plain"]["median"]
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"ours / plain: {result['ours_over_plain']:.2f}; figures in {args.out}")


if __name__ == "__main__":
    main()
