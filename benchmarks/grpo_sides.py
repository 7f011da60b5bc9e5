"""The two sides of benchmarks/grpo_cpu_vs_trl.py, each run in a subprocess of its own (`--child ours|trl`):
our trainer through `rlhf run`, and TRL's GRPOTrainer on the same prompts, reward and settings."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from types import ModuleType


def workload(job: dict) -> dict:
    """The knobs both sides are given, read from the job."""
    spec = job["spec"]
    rollout, training = spec["rollout"], spec["training"]
    samples = training["rolloutBatchSize"] * rollout["samplesPerPrompt"]
    return {
        "steps": training["maxSteps"],
        "prompts_per_step": training["rolloutBatchSize"],
        "samples_per_prompt": rollout["samplesPerPrompt"],
        "max_new_tokens": rollout["maxNewTokens"],
        "temperature": rollout["temperature"],
        "learning_rate": training["learningRate"],
        "train_batch_size": training["trainBatchSize"],
        "micro_train_batch_size": training["microTrainBatchSize"],
        "optimizer_steps_per_step": samples // training["trainBatchSize"],
        "kl_coef": training["kl"]["coef"],
        "kl_estimator": training["kl"]["estimator"],
        "seed": training["seed"],
        "dtype": spec["models"]["actor"]["dtype"],
        "attention": spec["models"]["actor"].get("attnImplementation", "sdpa"),  # the policy's (and TRL's reference's)
        "bf16": training.get("bf16", True),  # on float32 weights: autocast on both sides (Hugging Face Trainer's bf16)
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _reward_module(work: Path, task: dict) -> ModuleType:
    spec = importlib.util.spec_from_file_location("task_reward", work / task["files"] / "reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def final_model(work: Path, result: Path) -> Path:
    """Where a run (named by its result file) leaves its trained model: ours' checkpoint.path/final, TRL's save."""
    return work / f"{result.stem}-out" / "checkpoints" / "final"


def step_model(work: Path, result: Path, step: int) -> Path:
    """Where a run saving its policy after every step (--held-out-each-step) leaves step `step`'s."""
    return work / f"{result.stem}-out" / "steps" / f"step-{step}"


class SaveTimer:
    """Saves the policy after each step with `save(directory)`, timing it (the parent takes the seconds out of the
    run's times: the saves are the benchmark's, not the trainer's)."""

    def __init__(self, work: Path, result: Path, record: dict):
        self.work, self.result, self.saves = work, result, record.setdefault("saves", [])

    def __call__(self, step: int, save) -> None:
        started = time.time()
        save(str(step_model(self.work, self.result, step)))
        self.saves.append({"step": step, "started": started, "seconds": time.time() - started})


def held_out_score(model_dir: Path, work: Path) -> float:
    """The share of the task's held-out prompts the model answers right, greedily (Hugging Face generate, the job's
    maxNewTokens): one deterministic scorer for the base model and both sides' trained ones."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_trainer.data import render_prompt

    task = json.loads((work / "task.json").read_text())
    w = workload(yaml.safe_load((work / "job.yaml").read_text()))
    records = _records(work / task["files"] / task["held_out"])
    tokenizer = AutoTokenizer.from_pretrained(work / "model", padding_side="left")  # the base model's, both sides' own
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    inputs = tokenizer([render_prompt(r["prompt"], tokenizer, True) for r in records], return_tensors="pt",
                       padding=True, add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, do_sample=False, max_new_tokens=w["max_new_tokens"])
    texts = tokenizer.batch_decode(output[:, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    scores = _reward_module(work, task).score([], texts, [r["label"] for r in records])
    return sum(scores) / len(scores)


# ------------------------------------------------------------------------------ child: ours


def child_ours(work: Path, result: Path, save_each_step: bool = False) -> None:
    import ray
    import yaml

    from rlhf_trainer.reporting import JsonlWriter
    from rlhf_trainer.run import run
    from rlhf_trainer.trainer import Trainer

    record: dict = {"steps": []}
    if save_each_step:
        saver, steps = SaveTimer(work, result, record), Trainer._steps

        def saving_steps(self, batches):
            """Trainer._steps, the policy saved after each step: fit asks for the next step once it has logged this one."""
            for taken in steps(self, batches):
                yield taken
                saver(self.step, lambda directory: ray.get(self.trained.call("save_pretrained", directory)))

        Trainer._steps = saving_steps

    class Recorder:
        """Times the reporter calls: start() comes once the Trainer is built (Ray up, models and vLLM loaded)."""

        def start(self, total_steps: int) -> None:
            record["train_start"] = time.time()

        def log(self, step: int, metrics: dict[str, float]) -> None:
            record["steps"].append({"step": step, "time": time.time(), **metrics})

        def checkpoint(self, step: int, path: str) -> None:
            record["checkpoint_done"] = time.time()

        def finish(self, status: str, message: str = "") -> None:
            record["finish"] = time.time()

    out = work / f"{result.stem}-out"  # a fresh output dir: the job resumes from checkpoints it finds
    record["rc"] = run(work / "job.yaml", output_dir=out, reporters=[Recorder(), JsonlWriter(out / "metrics.jsonl")])
    record["exit"] = time.time()
    w = workload(yaml.safe_load((work / "job.yaml").read_text()))
    samples = w["prompts_per_step"] * w["samples_per_prompt"]
    for step in record["steps"]:  # response_length is the mean; tokens_per_second is per second of generation
        step["generated_tokens"] = step["response_length"] * samples
        step["generation_seconds"] = step["generated_tokens"] / step["tokens_per_second"]
    result.write_text(json.dumps(record))


# ------------------------------------------------------------------------------- child: TRL


def child_trl(work: Path, result: Path, save_each_step: bool = False) -> None:
    import torch
    import yaml
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_trainer.data import PromptLoader

    job = yaml.safe_load((work / "job.yaml").read_text())
    w = workload(job)
    model_path = job["spec"]["models"]["actor"]["path"]
    task = json.loads((work / "task.json").read_text())
    reward_module = _reward_module(work, task)

    # The prompts in the order our trainer draws them (PromptLoader, seed, epoch 0); TRL takes them
    # in dataset order (shuffle_dataset=False), so step k sees the same prompts on both sides.
    records = _records(work / task["files"] / task["prompts"])
    loader = PromptLoader(records, w["prompts_per_step"], seed=w["seed"])
    ordered = [record for batch in loader for record in batch][: w["steps"] * w["prompts_per_step"]]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                                 for r in ordered])

    record: dict = {"steps": [], "rewards": [], "generations": [], "rollouts": [], "optimizer_steps": []}
    kls: dict[int, float] = {}

    def reward(prompts, completions, completion_ids, label, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = reward_module.score(prompts, texts, label)
        record["rewards"].append({"time": time.time(), "reward_mean": sum(scores) / len(scores),
                                  "generated_tokens": sum(len(ids) for ids in completion_ids), "samples": len(scores)})
        return scores

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            record["train_start"] = time.time()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            record["optimizer_steps"].append({"global_step": state.global_step, "time": time.time()})
            if save_each_step and state.global_step % per_step == 0:
                saver(state.global_step // per_step, model.save_pretrained)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "kl" in logs:  # logging_steps=1: the mean k3 KL to the reference over the optimizer step's tokens
                kls[state.global_step] = logs["kl"]

    per_step = w["optimizer_steps_per_step"]
    saver = SaveTimer(work, result, record)
    accumulation = w["train_batch_size"] // w["micro_train_batch_size"]
    config = GRPOConfig(
        output_dir=str(work / f"{result.stem}-out"),
        report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, bf16=w["bf16"], fp16=False,
        gradient_checkpointing=False, dataloader_num_workers=0, seed=w["seed"], data_seed=w["seed"],
        max_steps=w["steps"] * per_step,
        per_device_train_batch_size=w["micro_train_batch_size"],
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation * per_step,  # one generation of prompts x samples feeds `per_step` optimizer steps
        num_generations=w["samples_per_prompt"], num_iterations=1, shuffle_dataset=False,
        max_completion_length=w["max_new_tokens"], temperature=w["temperature"], top_p=1.0, top_k=0,
        learning_rate=w["learning_rate"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.0, max_grad_norm=1.0,
        beta=w["kl_coef"], epsilon=0.2, loss_type="dapo", scale_rewards="group",
        model_init_kwargs={"dtype": getattr(torch, w["dtype"]), "attn_implementation": w["attention"]},
        use_vllm=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])

    generate = trainer.model.generate  # HF generate, as TRL calls it with use_vllm=False

    def timed_generate(*args, **kwargs):
        started = time.perf_counter()
        output = generate(*args, **kwargs)
        record["generations"].append(time.perf_counter() - started)
        return output

    trainer.model.generate = timed_generate
    make_experience = trainer._generate_and_score_completions  # generate, score, old and reference log-probs

    def timed_make_experience(*args, **kwargs):
        started = time.perf_counter()
        output = make_experience(*args, **kwargs)
        record["rollouts"].append(time.perf_counter() - started)
        return output

    trainer._generate_and_score_completions = timed_make_experience
    record["torch_threads"] = torch.get_num_threads()
    trainer.train()
    if task["held_out"]:  # as ours exports its final model for the held-out score
        trainer.save_model(str(final_model(work, result)))
    record["exit"] = time.time()

    ends = {s["global_step"]: s["time"] for s in record["optimizer_steps"]}
    for k, reward in enumerate(record["rewards"], start=1):
        if k * per_step not in ends:
            break
        record["steps"].append({"step": k, "time": ends[k * per_step], "reward_mean": reward["reward_mean"],
                                "generated_tokens": reward["generated_tokens"],
                                "generation_seconds": record["generations"][k - 1],
                                "rollout_seconds": record["rollouts"][k - 1],
                                # as ours' kl metric: the policy before this rollout's update, on its samples
                                "kl": kls.get((k - 1) * per_step + 1)})
    record["rc"] = 0
    result.write_text(json.dumps(record))
