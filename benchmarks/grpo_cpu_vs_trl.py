"""GRPO on CPU: our trainer (`rlhf run`: Ray + vLLM-CPU + DeepSpeed) next to TRL's GRPOTrainer, same toy workload.

    .venv/bin/python benchmarks/grpo_cpu_vs_trl.py   # 6-11 minutes on 2 cores, by load; writes
                                                     # benchmarks/results/grpo_cpu_vs_trl.json

The workload is the tiny example job (manifests/examples/tiny-grpo-cpu-job.yaml): a 2-layer
random Qwen2 built offline (rlhf_trainer.tiny.build_tiny_model), the toy prompts, the letter
reward. Both sides take the same 16 prompts per step (the very same prompts, in the order our
PromptLoader draws them), 8 samples each, 8 new tokens, temperature 1, lr 5e-3 constant, AdamW
(0.9, 0.95), grad clip 1, k3 KL in the loss with coefficient 0.001 against a frozen reference,
token-mean PPO-clip loss over the step's tokens (TRL loss_type "dapo"), 2 optimizer steps of 64 samples per rollout
(micro-batches of 16), float32. One "step" below is one rollout + its update: one step of ours,
two optimizer steps of TRL's. TRL generates with transformers `generate` (use_vllm=False) and
runs torch on all cores by default (torch's own default; --trl-threads N sets N), as our trainer runs each phase.

--model-shape runs another of rlhf_trainer.tiny.SHAPES (random weights, built offline, the same toy
prompts and reward; results then in grpo_cpu_vs_trl_<shape>.json), or `smollm2`: the real pretrained
SmolLM2-135M-Instruct on its example's task (manifests/examples/smollm2-grpo-cpu-job.yaml: sums,
scored after training on held-out pairs by one scorer for both sides: Hugging Face greedy generate); --set changes the job (its batch, lengths) on both sides: a
realistic shape's step is too slow for the tiny job's batch.

Each side runs in a subprocess of its own, one after the other (never at the same time); a
thread here samples the resident memory of that subprocess and all its descendants (Ray's
raylet, GCS and actors included). Pairs are repeated while the time budget allows, alternating
which side goes first; the summary is the median over repeats of per-run medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (  # noqa: E402  (this directory's shared helpers)
    ARITHMETIC,
    EXAMPLES,
    OFFLINE_ENV,
    TOY,
    TreeMemory,
    cpu_model,
    git_commit,
    load_job,
    results_path,
    total_memory,
    versions,
)
from grpo_sides import child_ours, child_trl, final_model, held_out_score, step_model, workload  # noqa: E402
from rlhf_trainer.tiny import SHAPES  # noqa: E402

SIDES = ("ours", "trl")


# ----------------------------------------------------------------------------------- the job


# Each model is benchmarked on a task: the random tiny shapes on the toy letter task, the real
# pretrained SmolLM2-135M-Instruct on single-digit additions with held-out pairs.
MODELS = {**dict.fromkeys(SHAPES, TOY), "smollm2": ARITHMETIC}


def prepare(work: Path, steps: int, model: str, settings: list[str]) -> dict:
    """The model and the job file (a copy of the task's example with absolute paths and `settings`, "dotted.key=YAML
    value" each) in `work`, and the task (task.json) the children read."""
    import yaml
    from rlhf_trainer.pretrained import point_models_at

    task = MODELS[model]
    if model == "smollm2":
        from rlhf_trainer.pretrained import build_smollm2

        model_dir = build_smollm2(work / "model")
    else:
        from rlhf_trainer.tiny import build_tiny_model

        model_dir = build_tiny_model(work / "model", shape=model)
    shutil.copytree(EXAMPLES / task.files, work / task.files, ignore=shutil.ignore_patterns("model"))
    job = load_job(steps, task)
    point_models_at(job["spec"], model_dir)
    if task.held_out:  # both sides' final models are scored on it: ours exports its final model as TRL saves its own
        job["spec"]["checkpoint"]["exportHf"] = True
    for setting in settings:
        dotted, _, value = setting.partition("=")
        *parents, leaf = dotted.split(".")
        node = job["spec"]
        for key in parents:
            node = node[key]
        node[leaf] = yaml.safe_load(value)
    (work / "job.yaml").write_text(yaml.safe_dump(job))
    (work / "task.json").write_text(json.dumps(asdict(task)))
    return job


# ----------------------------------------------------------------------------- the parent side


class RunFailed(Exception):
    pass


def run_side(side: str, work: Path, index: int, timeout: float, trl_threads: int, save_each_step: bool) -> dict:
    result = work / f"{side}-{index}.json"
    log = work / f"{side}-{index}.log"
    env = {**os.environ, **OFFLINE_ENV}
    if side == "trl" and trl_threads:
        env.update(OMP_NUM_THREADS=str(trl_threads), MKL_NUM_THREADS=str(trl_threads))
    load_before = os.getloadavg()
    launched = time.time()
    with log.open("w") as output:
        command = [sys.executable, __file__, "--child", side, "--work", str(work), "--result", str(result)]
        child = subprocess.Popen(command + (["--save-each-step"] if save_each_step else []),
                                 stdout=output, stderr=subprocess.STDOUT, env=env, cwd=work)
        memory = TreeMemory(child.pid)
        memory.start()
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()  # our own child, by its id
            rc = child.wait()
        memory.stop.set()
        memory.join()
    ended = time.time()
    leftover = []
    import psutil

    for pid in memory.seen - {child.pid}:
        try:
            leftover.append(f"{pid} {' '.join(psutil.Process(pid).cmdline()[:3])}")
        except psutil.NoSuchProcess:
            pass
    record = json.loads(result.read_text()) if result.is_file() else {}
    if rc != 0 or record.get("rc") != 0 or not record.get("steps"):
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        raise RunFailed(f"{side} run {index} failed (exit {rc}, run() returned {record.get('rc')}): "
                        f"{lines[-1] if lines else 'no output'} (log: {log})")
    record.update(load_before=load_before, launched=launched, ended=ended, peak_rss=memory.peak_rss, peak_pss=memory.peak_pss,
                  peak_processes=memory.peak_processes, rss_at_peak=memory.at_peak, threads=memory.threads,
                  leftover_processes=leftover)
    return record


def unsaved(record: dict, moment: float) -> float:
    """Seconds from the launch to `moment`, less the per-step saves of --held-out-each-step before it."""
    return moment - record["launched"] - sum(save["seconds"] for save in record.get("saves", []) if save["started"] < moment)


def time_to_target(record: dict, scores: list[float], target: float) -> dict:
    """The first step whose saved policy scores `target` or more on the held-out prompts, and the launch to its end
    (the saves left out); None for both if no step did."""
    reached = next((step for step, score in enumerate(scores, start=1) if score >= target), None)
    return {"held_out_per_step": [round(score, 4) for score in scores], "held_out_target_step": reached,
            "held_out_target_seconds": unsaved(record, record["steps"][reached - 1]["time"]) if reached else None}


def summarize(record: dict, warmup: int) -> dict:
    """Per-run numbers: medians over the steps after `warmup` (the per-step saves of --held-out-each-step left out)."""
    steps = [{**step, "time": record["launched"] + unsaved(record, step["time"])} for step in record["steps"]]
    ends = [record["train_start"]] + [s["time"] for s in steps]
    step_seconds = [b - a for a, b in zip(ends, ends[1:])]
    kept = range(warmup, len(steps))
    tokens = [steps[i]["generated_tokens"] for i in kept]
    gen = [steps[i]["generation_seconds"] for i in kept]
    seconds = [step_seconds[i] for i in kept]
    rewards = [s["reward_mean"] for s in steps]
    summary = {
        "steps": len(steps),
        "step_seconds_median": statistics.median(seconds),
        "step_seconds": [round(s, 3) for s in step_seconds],
        "first_step_seconds": step_seconds[0],
        "generation_seconds_median": statistics.median(gen),
        "generation_tokens_per_second_median": statistics.median(t / g for t, g in zip(tokens, gen)),
        "step_tokens_per_second_median": statistics.median(t / s for t, s in zip(tokens, seconds)),
        "generated_tokens_per_step_median": statistics.median(tokens),
        "loop_start_seconds": record["train_start"] - record["launched"],
        "first_step_done_seconds": steps[0]["time"] - record["launched"],
        "process_seconds": unsaved(record, record["ended"]),
        "after_last_step_seconds": record["ended"] - steps[-1]["time"],
        "peak_rss_mib": record["peak_rss"] / 2**20,
        "peak_pss_mib": record["peak_pss"] / 2**20,
        "peak_processes": record["peak_processes"],
        "reward_first_step": rewards[0],
        "reward_last_step": rewards[-1],
        "reward_per_step": [round(r, 4) for r in rewards],
        "kl_per_step": [round(s["kl"], 4) if s.get("kl") is not None else None for s in steps],
    }
    # rollout: generate, score, the actor's and reference's log-probs, advantages; update: the optimizer
    # steps (and, ours, the weight sync to vLLM). Ours reports both; TRL's update is the rest of the step.
    summary["rollout_seconds_median"] = statistics.median(steps[i]["rollout_seconds"] for i in kept)
    summary["update_seconds_median"] = statistics.median(
        steps[i]["update_seconds"] if "update_seconds" in steps[i] else step_seconds[i] - steps[i]["rollout_seconds"]
        for i in kept)
    # ours' own split of the step (time/generation, time/experience: the log-probs, time/update, time/weight_sync)
    summary["phase_seconds_median"] = {key: statistics.median(steps[i][key] for i in kept)
                                       for key in steps[0] if key.startswith("time/")}
    return summary


TABLE = [  # (label, key, format)
    ("step time (s)", "step_seconds_median", "{:.3f}"),
    ("- rollout: generate, score, log-probs (s)", "rollout_seconds_median", "{:.3f}"),
    ("- - of which generation (s)", "generation_seconds_median", "{:.3f}"),
    ("- update: optimizer steps (+ ours: weight sync) (s)", "update_seconds_median", "{:.3f}"),
    ("generated tokens / s, generation only", "generation_tokens_per_second_median", "{:.0f}"),
    ("generated tokens / s, whole step", "step_tokens_per_second_median", "{:.0f}"),
    ("generated tokens per step", "generated_tokens_per_step_median", "{:.0f}"),
    ("launch to training loop start (s)", "loop_start_seconds", "{:.1f}"),
    ("step 1 (s)", "first_step_seconds", "{:.1f}"),
    ("launch to end of step 1 (s)", "first_step_done_seconds", "{:.1f}"),
    ("whole process (s)", "process_seconds", "{:.1f}"),
    ("peak RSS, process tree (MiB)", "peak_rss_mib", "{:.0f}"),
    ("peak PSS, process tree (MiB)", "peak_pss_mib", "{:.0f}"),
    ("mean reward, first step", "reward_first_step", "{:.3f}"),
    ("mean reward, last step", "reward_last_step", "{:.3f}"),
    ("held-out score after training (greedy)", "held_out_score", "{:.3f}"),
    ("first step whose policy reaches the held-out target", "held_out_target_step", "{:.0f}"),
    ("launch to the end of that step (s)", "held_out_target_seconds", "{:.1f}"),
]


def combine(runs: dict[str, list[dict]]) -> dict:
    """Median over repeats of each per-run number, and ours / TRL."""
    table = {}
    for _, key, _ in TABLE:
        row = {}
        for side in SIDES:
            values = [r[key] for r in runs[side] if r.get(key) is not None]
            row[side] = statistics.median(values) if values else None
        row["ratio_ours_over_trl"] = row["ours"] / row["trl"] if row["ours"] is not None and row["trl"] else None
        table[key] = row
    return table


def markdown(table: dict, runs: dict[str, list]) -> str:
    counts = " / ".join(f"{len(runs[side])}" for side in SIDES)
    lines = [f"| medians over runs (ours / TRL: {counts}) | ours | TRL | ours / TRL |", "|---|---:|---:|---:|"]
    for label, key, fmt in TABLE:
        row = table[key]
        cells = [fmt.format(row[s]) if row[s] is not None else "n/a" for s in SIDES]
        ratio = f"{row['ratio_ours_over_trl']:.2f}" if row["ratio_ours_over_trl"] is not None else "n/a"
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="rollout+update steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="pairs at most (default 5; fewer if the budget ends)")
    parser.add_argument("--budget-minutes", type=float, default=11.0,
                        help="start another pair only if it should end within this (default 11)")
    parser.add_argument("--trl-threads", type=int, default=0,
                        help="torch threads of the TRL process (default 0: torch's default, one per core, TRL at its "
                             "best here and what our trainer gives each phase: workers/threads.py)")
    parser.add_argument("--model-shape", choices=MODELS, default="tiny",
                        help="a random model of one of rlhf_trainer.tiny.SHAPES on the toy task, or smollm2: the real "
                             "pretrained SmolLM2-135M-Instruct on its arithmetic task, scored on held-out prompts (default tiny)")
    parser.add_argument("--held-out-each-step", type=float, metavar="TARGET",
                        help="smollm2: both sides save the policy after every step (the saves' time left out of every "
                             "figure); each saved policy is scored on the held-out prompts, in step order, until one "
                             "reaches TARGET (e.g. 0.75): the time to that score")
    parser.add_argument("--seed-per-pair", action="store_true",
                        help="pair k runs with training.seed + k on both sides (sampling and prompt order): the "
                             "held-out figures then span k seeds, not one seed's samples repeated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                        help="a job spec field for both sides, by dotted path (training.rolloutBatchSize=8); repeatable")
    parser.add_argument("--out", type=Path, help="results JSON (default results/grpo_cpu_vs_trl[_<shape>].json)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (model, logs, outputs)")
    parser.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--save-each-step", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        (child_ours if args.child == "ours" else child_trl)(args.work, args.result, args.save_each_step)
        return 0
    if args.held_out_each_step is not None and MODELS[args.model_shape].held_out is None:
        parser.error(f"--held-out-each-step needs a task with held-out prompts (--model-shape smollm2), not {args.model_shape}")

    import yaml

    args.out = args.out or results_path("grpo_cpu_vs_trl", args.model_shape)
    os.environ.update(OFFLINE_ENV)
    started = time.time()
    load_start = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    job = prepare(work, args.steps, args.model_shape, args.settings)
    print(f"work dir {work}; load average at start {load_start}", flush=True)
    held_out = MODELS[args.model_shape].held_out is not None
    baseline = held_out_score(work / "model", work) if held_out else None
    if held_out:
        print(f"held-out mean reward of the model before training: {baseline:.3f}", flush=True)

    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    raw: list[dict] = []
    failures: list[dict] = []
    pair_seconds: list[float] = []
    for index in range(args.repeats):
        elapsed = time.time() - started
        if pair_seconds and elapsed + max(pair_seconds) > args.budget_minutes * 60:
            print(f"stopping after {index} pair(s): another would pass the {args.budget_minutes} min budget", flush=True)
            break
        pair_started = time.time()
        seed = job["spec"]["training"]["seed"] + (index if args.seed_per_pair else 0)
        if args.seed_per_pair:
            (work / "job.yaml").write_text(yaml.safe_dump({**job, "spec": {
                **job["spec"], "training": {**job["spec"]["training"], "seed": seed}}}))
        order = SIDES if index % 2 == 0 else SIDES[::-1]
        for side in order:
            try:
                record = run_side(side, work, index, timeout=args.budget_minutes * 60, trl_threads=args.trl_threads,
                                  save_each_step=args.held_out_each_step is not None)
            except RunFailed as failure:  # kept in the results; the pair's other run still counts
                print(failure, flush=True)
                failures.append({"repeat": index, "side": side, "error": str(failure)})
                args.keep = True  # its log stays in the work dir
                continue
            summary = summarize(record, args.warmup)
            result = work / f"{side}-{index}.json"
            if held_out:
                summary["held_out_score"] = held_out_score(final_model(work, result), work)
            if args.held_out_each_step is not None:
                scores = []
                for step in range(1, summary["steps"] + 1):
                    scores.append(held_out_score(step_model(work, result, step), work))
                    if scores[-1] >= args.held_out_each_step:
                        break
                summary.update(time_to_target(record, scores, args.held_out_each_step))
            runs[side].append(summary)
            raw.append({"repeat": index, "side": side, "seed": seed, "load_average_before": record.get("load_before"),
                        "max_os_threads_by_process": record["threads"],
                        "rss_at_peak_mib": {f"{name} (x{count})" if count > 1 else name: round(rss / 2**20)
                                            for name, (count, rss) in
                                            sorted(record["rss_at_peak"].items(), key=lambda kv: -kv[1][1])},
                        "leftover_processes": record["leftover_processes"],
                        **({"torch_threads": record["torch_threads"]} if "torch_threads" in record else {}),
                        **summary})
            print(f"repeat {index} {side}: step {summary['step_seconds_median']:.3f} s, "
                  f"gen {summary['generation_tokens_per_second_median']:.0f} tok/s, "
                  f"peak RSS {summary['peak_rss_mib']:.0f} MiB, step 1 done at {summary['first_step_done_seconds']:.1f} s, "
                  f"reward {summary['reward_first_step']:.3f} -> {summary['reward_last_step']:.3f}", flush=True)
        pair_seconds.append(time.time() - pair_started)

    table = combine(runs)
    results = {
        "command": "python benchmarks/grpo_cpu_vs_trl.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "processor": cpu_model(), "python": platform.python_version(),
                    "memory_gib": round(total_memory() / 2**30, 1)},
        "versions": versions(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "wall_seconds": time.time() - started,
        "workload": {"model_shape": args.model_shape, **workload(job)},
        "held_out_score_before_training": baseline,
        "held_out_target": args.held_out_each_step,
        "warmup_steps_excluded": args.warmup,
        "trl_threads": args.trl_threads or "torch default",
        "runs_per_side": {side: len(runs[side]) for side in SIDES},
        "failed_runs": failures,
        "summary": table,
        "summary_markdown": markdown(table, runs),
        "runs": raw,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.keep:
        print(f"work dir kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(results["summary_markdown"])
    print(f"load average: start {load_start}, end {results['load_average_end']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
