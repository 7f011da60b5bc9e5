"""The GPU memory plan (rlhf_api/planning/memory.py): parameter counts equal the models' own, the bytes
per GPU and phase follow from them by the rules the module states, and a job that cannot fit is refused
with its numbers, by `rlhf validate --gpu` and by `rlhf run` before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config

from rlhf_api.validation import InvalidJob, validate
from rlhf_cli.cli import main
from rlhf_api.planning.memory import (CUDA_CONTEXT, DEEPSPEED_BUFFERS, ENGINE, GIB, HOST_PROCESS, NCCL_PEERS,
                                     ZERO3_LIVE_PARAMETERS, Shape, gpu_bytes, local_config, plan_job, plan_memory,
                                     refuse_unless_fits)
from rlhf_api.planning.placement import Placement
from rlhf_trainer.tiny import build_tiny_model

EXAMPLES = Path(__file__).parents[2] / "manifests" / "examples"
CONFIGS = EXAMPLES / "model-configs"
LLAMA3_8B = CONFIGS / "meta-llama" / "Meta-Llama-3-8B"
QWEN25_7B = CONFIGS / "Qwen" / "Qwen2.5-7B-Instruct"


# benchmarks/gpu_check.py's results from real GPUs, by file name
GPU_CHECKS = {path.stem: json.loads(path.read_text())
              for path in sorted((EXAMPLES.parents[1] / "benchmarks" / "results").glob("gpu_check_*.json"))}


def test_the_cuda_context_per_process_is_no_less_than_a_gpu_measured():
    """benchmarks/gpu_check.py's figure from a real GPU (its results file): the context, cuBLAS workspace and
    NCCL buffers a process holds beyond torch's allocator. The plan assumed 0.5 GiB before the first GPU
    measured 1.30 (H200, 2026-11-27)."""
    measured = [check["zero3_step"]["context_gib"] for check in GPU_CHECKS.values()]
    assert measured and CUDA_CONTEXT / GIB >= max(measured) - 0.005, (CUDA_CONTEXT / GIB, measured)


@pytest.mark.parametrize("name", GPU_CHECKS)
def test_the_plan_bounds_the_training_step_a_gpu_measured(name):
    """The train phase the plan gives gpu_check's model and micro-batch (one ZeRO-3 bf16 rank) is at least the
    step's measured peak of allocated memory, and not far above it. Before DEEPSPEED_BUFFERS the plan gave
    0.84 GiB against a measured 1.73 for 39M parameters; 0.34M parameters peaked at 1.00 GiB: DeepSpeed's
    buffers do not scale with the model (H200, 2026-11-27)."""
    check = GPU_CHECKS[name]
    rows, sequence = check["zero3_step"]["batch"]
    spec = validate({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "gpu-check"}, "spec": {
        "algorithm": "sft", "models": {"actor": {"path": "model", "dtype": check.get("weights_dtype", check["dtype"])}},
        "data": {"sft": {"sources": [{"path": "data.jsonl"}]}, "maxTokens": sequence},
        "training": {**check["training"], "microTrainBatchSize": rows},
        "resources": {"nodes": 1, "gpusPerNode": 1}}}).spec
    placement = Placement(use_gpu=True, bundles=1, ranks={"actor": [0]})
    plan = plan_memory(spec, placement, {"actor": Shape.from_config(check["model_config"])}, "NVIDIA-H200")
    [actor] = plan.gpus[0].processes
    planned, measured = (sum(actor.held.values()) + actor.extra["train"]) / GIB, check["zero3_step"]["peak_allocated_gib"]
    assert measured <= planned <= 1.5 * measured, (planned, measured)


def _counted(config, value_head: bool) -> int:
    """The parameters transformers builds for this config (on the meta device: no memory)."""
    auto = AutoModelForSequenceClassification if value_head else AutoModelForCausalLM
    config.num_labels = 1
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("value_head", [False, True], ids=["lm", "value-head"])
@pytest.mark.parametrize("model", ["llama3-8b", "qwen2.5-7b", "tiny-qwen2", "tiny-gpt2"])
def test_parameters_counted_from_the_config_equal_the_models(model, value_head, tmp_path):
    if model == "tiny-qwen2":
        path = build_tiny_model(tmp_path / "tiny")
    elif model == "tiny-gpt2":
        GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=2).save_pretrained(tmp_path)
        path = tmp_path
    else:
        path = LLAMA3_8B if model == "llama3-8b" else QWEN25_7B
    config = json.loads((path / "config.json").read_text())
    assert Shape.from_config(config, value_head).params == _counted(AutoConfig.from_pretrained(path), value_head)


def test_the_published_sizes():
    assert Shape.from_config(json.loads((LLAMA3_8B / "config.json").read_text())).params == 8_030_261_248
    assert Shape.from_config(json.loads((QWEN25_7B / "config.json").read_text())).params == 7_615_616_512


def _job(name: str, **changes) -> object:
    manifest = __import__("yaml").safe_load((EXAMPLES / f"{name}-job.yaml").read_text())
    for dotted, value in changes.items():
        *path, last = dotted.split(".")
        node = manifest["spec"]
        for key in path:
            node = node.setdefault(key, {})
        node[last] = value
    return validate(manifest).spec


def _plan(spec, gpu="NVIDIA-H100-80GB-HBM3"):
    return plan_job(spec, gpu, local_config(CONFIGS, EXAMPLES, spec))


def test_grpo_example_bytes_per_gpu_follow_from_the_parameters():
    """8 GPUs all shared (colocation all): ZeRO-3 splits the actor's and the reference's weights 8 ways, the
    actor's gradients and AdamW state too; a vLLM worker of tensor-parallel width 2 beside them, its share 0.5 of
    each GPU while it samples. Each pass counted by hand from the rules planning/memory.py states."""
    spec = _job("grpo")
    plan = _plan(spec)
    params, total = 7_615_616_512, gpu_bytes("NVIDIA-H100-80GB-HBM3")
    hidden, vocab, layers = 3584, 152064, 28
    assert total == 81559 << 20
    gpu = plan.gpus[0]
    actor, reference, engine = gpu.processes
    assert actor.held == {"weights": params * 2 // 8, "gradients": params * 2 // 8, "optimizer": params * 12 // 8,
                          "deepspeed buffers": DEEPSPEED_BUFFERS, "NCCL peers": NCCL_PEERS}
    assert reference.held == {"weights": params * 2 // 8, "NCCL peers": NCCL_PEERS}
    assert engine.name == ENGINE and engine.resident == NCCL_PEERS + CUDA_CONTEXT  # its tensor-parallel group
    # ZeRO-3 gathers DeepSpeed's default live parameters; the logits of the 2048 + 1 response positions only
    scoring, micro, prompt, response = 8, 4, 1024, 2048
    gathered = ZERO3_LIVE_PARAMETERS * 2
    score = gathered + scoring * (response + 1) * vocab * 12 + 34 * scoring * (prompt + response) * hidden
    tokens = micro * (prompt + response)  # gradient checkpointing: each layer's input, and one layer's working set
    train = gathered + micro * (response + 1) * vocab * 16 + layers * tokens * hidden * 2 + 34 * tokens * hidden
    assert (spec.training.micro_rollout_batch_size, spec.training.micro_train_batch_size) == (scoring, micro)
    assert (spec.data.max_prompt_tokens, spec.rollout.max_new_tokens) == (prompt, response)
    assert actor.extra == {"score": score, "train": train} and reference.extra == {"score": score}
    assert gpu.engine_share == 0.5
    resident = actor.resident + reference.resident + engine.resident
    assert gpu.phase("generate", total) == resident + int(0.5 * total)
    assert gpu.phase("score", total) == resident + score  # the passes take turns: the larger, not their sum
    assert gpu.phase("train", total) == resident + train
    assert plan.fits and all(len(g.processes) == 3 for g in plan.gpus)


def test_a_long_prompt_is_charged_logits_for_its_response_only():
    """The forward keeps the logits of the response positions (logits_to_keep): a 16k-token prompt with 256-token
    answers costs its layers 16k tokens and its logits 257 positions (the plan charged all 16.6k: ~65x)."""
    spec = _job("grpo", **{"data.maxPromptTokens": 16384, "rollout.maxNewTokens": 256})
    actor = _plan(spec).gpus[0].processes[0]
    tokens, logits = 8 * (16384 + 256), 8 * 257 * 152064  # 8 rows a scoring micro-batch
    assert actor.extra["score"] == ZERO3_LIVE_PARAMETERS * 2 + logits * 12 + 34 * tokens * 3584


def test_a_preference_job_is_charged_its_chosen_and_rejected_rows_in_one_pass():
    """The dpo example (Llama-3-8B, 8192-token rows, micro-batches of 1 pair, actor and reference on 4 GPUs each,
    ZeRO-3): preference_step reads a pair's chosen and rejected rows in one forward, so each pass carries 2 x 8192
    tokens through the layers and their logits (the plan once charged one row: the catalogue's dataset is
    "preferences")."""
    spec = _job("dpo")
    hidden, vocab, layers = 4096, 128256, 32
    tokens = 2 * spec.training.micro_train_batch_size * spec.data.max_tokens
    assert tokens == 2 * 8192
    gathered = ZERO3_LIVE_PARAMETERS * 2
    train = gathered + tokens * vocab * 16 + layers * tokens * hidden * 2 + 34 * tokens * hidden  # checkpointed
    score = gathered + tokens * vocab * 12 + 34 * tokens * hidden
    plan = _plan(spec)
    [actor], [reference] = plan.gpus[0].processes, plan.gpus[4].processes
    assert actor.extra == {"train": train} and reference.extra == {"score": score}
    assert plan.fits


def test_the_optimizer_step_s_fp32_gradients_are_charged_when_larger_than_the_activations():
    """DeepSpeed steps bf16 weights from an fp32 copy of the gradient partition: one rank (nothing split) of a
    7B model with a tiny micro-batch needs it, not the activations, at the step."""
    spec = _job("sft", **{"resources.gpusPerNode": 1, "training.zeroStage": 1, "data.maxTokens": 16,
                          "training.microTrainBatchSize": 1, "training.trainBatchSize": 1})
    [actor] = _plan(spec, gpu="NVIDIA-H200").gpus[0].processes
    assert actor.extra["train"] == 8_030_261_248 * 4


def test_host_memory_per_worker_pod_is_planned_and_the_default_pod_holds_every_gpu_example():
    """Issue 50: an 8-GPU GRPO pod got 32 GiB, /dev/shm counted in it, while its 8 sleeping vLLM workers pin
    their weights (Qwen2.5-7B at tensor-parallel 2: ~57 GiB) in host memory. The default worker memory is now
    shmSize + 32Gi a GPU, and each GPU example's host plan fits it or its own worker.memory."""
    spec = _job("grpo")
    plan = _plan(spec)
    pod, host = plan.pod_host()
    assert spec.resources.worker.memory is None and spec.resources.worker_memory == "272Gi"  # 16Gi + 8 x 32Gi
    assert plan.pod_limit == 272 * GIB
    assert host == {"/dev/shm": 16 * GIB, "process": 8 * 3 * HOST_PROCESS,
                    "vLLM weights asleep (pinned)": 8 * (7_615_616_512 * 2 // 2)}
    for example in sorted(EXAMPLES.glob("*-job.yaml")):
        job = validate(__import__("yaml").safe_load(example.read_text())).spec
        if job.resources.gpus_per_node:
            assert _plan(job).host_fits, (example.name, _plan(job).render())


def test_a_pod_short_of_host_memory_is_refused_naming_worker_memory_and_the_size_it_needs():
    plan = _plan(_job("grpo", **{"resources.worker.memory": "64Gi"}))
    assert not plan.host_fits and not plan.fits
    with pytest.raises(InvalidJob) as refused:
        refuse_unless_fits(plan)
    [error] = refused.value.errors
    needed = sum(plan.pod_host()[1].values())
    assert error.path == "spec.resources.worker.memory"
    assert f"would hold {needed / GIB:.1f} GiB of host memory" in error.message
    assert f"set resources.worker.memory to {-(-needed // GIB)}Gi or more" in error.message


@pytest.mark.parametrize("name, label", [("H100", "NVIDIA-H100-80GB-HBM3"), ("h200", "NVIDIA-H200"),
                                         ("A100-80GB", "NVIDIA-A100-SXM4-80GB"), ("L40S", "NVIDIA-L40S")])
def test_gpus_by_the_names_people_type(name, label):
    assert gpu_bytes(name) == gpu_bytes(label)


@pytest.mark.parametrize("change, fits", [
    ({}, True),
    ({"training.zeroStage": 1}, False),  # each rank keeps all weights and gradients: 8x more of both
    ({"training.zeroStage": 1, "training.offloadOptimizer": True, "rollout.gpuMemoryUtilization": 0.3}, True),
])
def test_zero_stage_offload_and_vllm_s_share_move_the_peak(change, fits):
    assert _plan(_job("grpo", **change)).fits is fits


def test_a_job_that_does_not_fit_is_refused_with_its_numbers_and_what_to_change():
    plan = _plan(_job("grpo"), gpu="NVIDIA-L4")
    assert not plan.fits
    with pytest.raises(InvalidJob) as refused:
        refuse_unless_fits(plan)
    message = str(refused.value)
    gpu, phase, used = plan.peak()
    assert f"GPU {gpu.index} would hold {used / GIB:.1f} GiB of {plan.total / GIB:.1f} GiB" in message
    assert "zeroStage 3, offloadOptimizer" in message and "more GPUs" in message
    assert "actor rank 0: weights" in message  # the plan itself


def test_rlhf_validate_prints_the_plan_of_each_gpu_example_and_fails_one_that_does_not_fit(capsys):
    examples = sorted(str(p) for p in EXAMPLES.glob("*-job.yaml"))
    assert main(["validate", "--gpu", "H100", "--model-configs", str(CONFIGS), *examples]) == 0
    out = capsys.readouterr().out
    assert out.count("peak: GPU") == sum("gpusPerNode: 0" not in Path(p).read_text() for p in examples)
    assert out.count("host memory of worker pod") == out.count("peak: GPU")
    assert out.count("runs on CPU") == sum("gpusPerNode: 0" in Path(p).read_text() for p in examples)
    assert "DOES NOT FIT" not in out
    assert main(["validate", "--gpu", "24GiB", "--model-configs", str(CONFIGS), str(EXAMPLES / "ppo-job.yaml")]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_rlhf_run_refuses_a_gpu_job_that_cannot_fit_before_any_model_loads(toy_job, tmp_path, capsys):
    """The actor on a local path (its config.json read, no weights there): 8 GPUs of 24 GB cannot hold
    Llama-3-8B's training state beside vLLM's share."""
    job = toy_job(**{"models.actor.path": str(LLAMA3_8B), "resources.gpusPerNode": 8,
                     "resources.gpuProduct": "NVIDIA-L4", "training.colocation": "all", "training.zeroStage": 1})
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "spec.resources: the job does not fit NVIDIA-L4" in error and "actor rank 0" in error, error


def test_rlhf_run_plans_a_hub_model_from_its_config_alone_and_refuses_what_cannot_fit(toy_job, tmp_path, capsys,
                                                                                      monkeypatch):
    """Issue 50: the plan was not enforced for models named by hub id (both GPU examples). The trainer now reads
    the hub's config.json alone, before any GPU is touched: here from a Hugging Face cache, offline, laid out as
    huggingface_hub lays it out (no hub is reachable here)."""
    import huggingface_hub.constants

    commit = "0" * 40
    snapshot = tmp_path / "hub" / "models--meta-llama--Meta-Llama-3-8B"
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text(commit)
    (snapshot / "snapshots" / commit).mkdir(parents=True)
    (snapshot / "snapshots" / commit / "config.json").write_text((LLAMA3_8B / "config.json").read_text())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    job = toy_job(**{"models.actor.path": "meta-llama/Meta-Llama-3-8B", "resources.gpusPerNode": 8,
                     "resources.gpuProduct": "NVIDIA-L4", "training.colocation": "all", "training.zeroStage": 1})
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "spec.resources: the job does not fit NVIDIA-L4" in error and "actor rank 0" in error, error


@pytest.mark.parametrize("stage, per_parameter", [(0, 8), (2, 12)])
def test_zero_keeps_an_fp32_copy_of_float32_weights_for_its_optimizer(stage, per_parameter):
    """benchmarks/gpu_check.py's plan_terms measured 4.11 GiB beyond a 151M float32 model's weights where the plan
    said 3.69: ZeRO's optimizer steps a copy of its partition of the weights, float32 ones too; ZeRO-0 steps them
    in place."""
    spec = _job("sft", **{"resources.gpusPerNode": 1, "training.zeroStage": stage, "models.actor.dtype": "float32",
                          "training.bf16": False})
    [actor] = _plan(spec, gpu="NVIDIA-H200").gpus[0].processes
    assert actor.held["optimizer"] == 8_030_261_248 * per_parameter


def test_tensor_parallel_splits_the_layers_of_the_actor_and_zero_splits_over_the_data_parallel_ranks():
    """The grpo example (Qwen2.5-7B, 8 shared GPUs) with training.tensorParallel 2 under ZeRO-2: each actor rank holds
    half of every layer's linear weights and biases (embedding and norms whole), ZeRO-2 splits its gradients and
    AdamW state over the 8 / 2 = 4 data-parallel ranks; the reference stays whole (ZeRO-0 under ZeRO-2)."""
    spec = _job("grpo", **{"training.tensorParallel": {"size": 2}, "training.zeroStage": 2})
    params, hidden, intermediate, layers, kv = 7_615_616_512, 3584, 18944, 28, 4 * 128
    layer = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden + 3 * hidden * intermediate
    split = layers * layer  # q, k, v with their biases, o, gate, up, down: what AutoTP splits
    own = params - split + split // 2
    actor, reference, _ = _plan(spec).gpus[0].processes
    assert actor.held == {"weights": own * 2, "gradients": own * 2 // 4, "optimizer": own * 12 // 4,
                          "deepspeed buffers": DEEPSPEED_BUFFERS, "NCCL peers": NCCL_PEERS}
    assert reference.held == {"weights": params * 2, "NCCL peers": NCCL_PEERS}
    # the weight sync's gather after the step: 3 buckets of 256 MiB (its largest weight, 3584 x 18944 in bfloat16, is less)
    assert actor.extra["train"] >= 3 * 256 << 20 and 2 * hidden * intermediate < 256 << 20
    whole = _plan(_job("grpo", **{"training.zeroStage": 2})).gpus[0].processes[0]
    assert whole.held["weights"] - actor.held["weights"] == (split - split // 2) * 2  # 6.08 GiB of 14.2 each


def test_sequence_parallel_divides_a_long_answer_s_activations_and_logits_over_its_ranks():
    """The long-answer example (Qwen2.5-7B, 1024 + 16384 tokens a sample, micro-batches of 2, 8 shared GPUs, ZeRO-3):
    with training.sequenceParallel 4 each rank runs 2 x 17408 / 4 = 8704 tokens through the layers and computes the
    logits of at most those; the all-to-all's buffers and sdpa's whole-row mask come on top; ZeRO still shards over
    all 8 ranks. It fits on H100s, and without the split the same job does not."""
    spec = _job("grpo-long-answers")
    hidden, vocab, layers, kv = 3584, 152064, 28, 4 * 128
    rows, row = 2, 1024 + 16384
    tokens = rows * row // 4
    gathered = ZERO3_LIVE_PARAMETERS * 2
    buffers = 2 * (2 * hidden + 2 * kv) * tokens * 2 + rows * row ** 2  # all-to-all pieces and received; the mask
    train = gathered + tokens * vocab * 16 + layers * tokens * hidden * 2 + 34 * tokens * hidden + buffers
    score = gathered + tokens * vocab * 12 + 34 * tokens * hidden + buffers
    plan = _plan(spec)
    actor, reference, _ = plan.gpus[0].processes
    assert actor.extra == {"score": score, "train": train} and reference.extra == {"score": score}
    assert actor.held["weights"] == 7_615_616_512 * 2 // 8  # ZeRO-3 over all 8 ranks, not 8 / 4
    assert plan.fits
    whole = _plan(_job("grpo-long-answers", **{"training.sequenceParallel": {"size": 1}}))
    assert not whole.fits and whole.peak()[1] == "train"
    assert whole.gpus[0].processes[0].extra["train"] > 3 * train  # the logits of all 2 x 16385 response positions


def test_rlhf_validate_prints_the_long_answer_plan_that_fits_only_with_sequence_parallelism(capsys, tmp_path):
    example = EXAMPLES / "grpo-long-answers-job.yaml"
    assert main(["validate", "--gpu", "H100", "--model-configs", str(CONFIGS), str(example)]) == 0
    assert "fits" in capsys.readouterr().out
    whole = tmp_path / "grpo-long-answers-job.yaml"
    whole.write_text(example.read_text().replace("size: 4", "size: 1"))
    assert main(["validate", "--gpu", "H100", "--model-configs", str(CONFIGS), str(whole)]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_a_vision_language_model_s_tower_and_projector_are_counted_exactly(tmp_path):
    """Qwen2-VL's (the tiny VLM) and Qwen2.5-VL's (a small random config) parameters, tower and projector apart."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from rlhf_trainer.tiny_vlm import build_tiny_vlm

    qwen25 = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=64),
        tie_word_embeddings=False)
    for config in (json.loads((build_tiny_vlm(tmp_path / "tiny") / "config.json").read_text()), qwen25.to_dict()):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**config))
        shape = Shape.from_config(config)
        named = dict(model.named_parameters())
        projector = sum(p.numel() for name, p in named.items() if ".visual.merger." in name)
        tower = sum(p.numel() for name, p in named.items() if ".visual." in name) - projector
        assert (shape.params, shape.vision.tower_params, shape.vision.projector_params) == (
            sum(p.numel() for p in named.values()), tower, projector)


def test_the_vlm_example_plans_its_tower_frozen_or_trained():
    """The Qwen2.5-VL example: the frozen tower holds weights but no gradients or optimizer state, and its passes
    add one tower block's activations over the rows' image patches (every block's when it trains)."""
    frozen, trained = _plan(_job("qwen2.5-vl-grpo")), _plan(_job("qwen2.5-vl-grpo", **{"training.freezeVisionTower": False}))
    spec = _job("qwen2.5-vl-grpo")
    vision = Shape.from_config(json.loads((CONFIGS / "Qwen/Qwen2.5-VL-7B-Instruct/config.json").read_text())).vision
    actor, trained_actor = frozen.gpus[0].processes[0], trained.gpus[0].processes[0]
    assert actor.held["weights"] == trained_actor.held["weights"]
    assert trained_actor.held["gradients"] - actor.held["gradients"] == vision.tower_params * 2 // 8
    assert trained_actor.held["optimizer"] - actor.held["optimizer"] == vision.tower_params * 12 // 8
    patches = spec.training.micro_train_batch_size * spec.data.max_prompt_tokens * vision.merge
    assert trained_actor.extra["train"] - actor.extra["train"] == 34 * patches * vision.width * (vision.depth - 1)
    assert frozen.fits and trained.fits
