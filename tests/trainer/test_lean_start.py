"""What keeps a run lean: the vLLM KV cache sized from the job (kv_cache_bytes) and holding a whole
rollout, a local Ray node without the processes a run does not use (run._start_local_ray), and the
actor's and reference's log-prob passes run at once with the results of running them one by one, in
ranks whose DeepSpeed import left MLflow out, and the engine's imports frozen in its actor's process only."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import types

import pytest
import ray
import torch
from ray.util.placement_group import remove_placement_group
from transformers import AutoConfig, AutoTokenizer, Qwen2Config

from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import ModelSpec, RolloutSpec, TrainingSpec
from rlhf_trainer.trainer import Trainer
from rlhf_trainer.workers import an_actor_s_own_process
from rlhf_trainer.workers.engine import ModelConfig
from rlhf_trainer.workers.group import ModelGroup, create_placement_group, create_rollout_engines
from rlhf_trainer.workers.rollout import CPU_BLOCK_SIZE, MAX_NUM_SEQS, kv_cache_bytes

pytestmark = pytest.mark.timeout(300)


def test_kv_cache_bytes_counts_whole_blocks_of_every_sequence_in_flight():
    # 24 layers x K and V x 2 KV heads x head_dim 64 (896 / 14) x 2 bytes (bfloat16) = 12288 bytes a token
    config = Qwen2Config(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    # 1000 tokens take 8 blocks of 128; 64 sequences, and vLLM's null block
    assert kv_cache_bytes(config, "bfloat16", max_model_len=1000, sequences=64, block_size=128) \
        == (64 * 8 + 1) * 128 * 12288
    # float32 doubles it; vLLM never runs more than MAX_NUM_SEQS at once
    assert kv_cache_bytes(config, "float32", max_model_len=1000, sequences=64, block_size=128) \
        == 2 * (64 * 8 + 1) * 128 * 12288
    assert kv_cache_bytes(config, "bfloat16", max_model_len=1000, sequences=10_000, block_size=128) \
        == (MAX_NUM_SEQS * 8 + 1) * 128 * 12288


def test_engine_cache_holds_the_rollout_of_the_tiny_job(tiny_model, local_ray):
    """The example job: 16 prompts x 8 samples of up to 64 + 8 tokens, one block each."""
    placement = Placement(use_gpu=False, bundles=1, ranks={"rollout": [0]})
    group = create_placement_group(placement)
    [engine] = create_rollout_engines(group, placement, str(tiny_model), rollout=RolloutSpec(), dtype="float32",
                                      max_model_len=72, seed=0, sequences=16 * 8)
    try:
        cache = ray.get(engine.__ray_call__.remote(lambda self: self.llm.llm_engine.vllm_config.cache_config))
        assert (cache.block_size, cache.num_gpu_blocks) == (CPU_BLOCK_SIZE, 16 * 8 + 1)
        # The engine froze its imports before vLLM's start collected garbage (rollout.py): in its actor's own
        # process, not in this one, which runs engines and ranks in-process in other tests.
        assert ray.get(engine.__ray_call__.remote(lambda self: an_actor_s_own_process())) is True
        assert an_actor_s_own_process() is False
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Ada: Say c."}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        longest = [prompt + [prompt[-1]] * (64 - len(prompt))]  # a prompt of maxPromptTokens
        completions, _ = ray.get(engine.generate.remote(longest * 16, {"n": 8, "max_tokens": 8, "ignore_eos": True}))
        assert [len(c.token_ids) for per_prompt in completions for c in per_prompt] == [8] * 128
    finally:
        ray.kill(engine)
        remove_placement_group(group)


def test_log_probs_of_actor_and_reference_at_once_equal_one_after_the_other(tiny_model, local_ray):
    placement = Placement(use_gpu=False, bundles=2, ranks={"actor": [0], "reference": [1]})
    bundles = create_placement_group(placement)
    groups = {role: ModelGroup(role, bundles, placement) for role in ("actor", "reference")}
    try:
        training = TrainingSpec(zero_stage=2, bf16=False, micro_rollout_batch_size=4)
        model = ModelSpec(path=str(tiny_model), dtype="float32")
        ray.get([ref for role, group in groups.items()
                 for ref in group.setup(ModelConfig(role=role, path=str(tiny_model), model=model, training=training))])
        generator = torch.Generator().manual_seed(0)
        vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
        sequences = torch.randint(3, vocab, (10, 20), generator=generator)
        attention_mask = torch.ones_like(sequences)
        attention_mask[::3, :4] = 0  # left padding on some rows
        action_mask = torch.ones(10, 8, dtype=torch.bool)
        one_by_one = [groups[role].forward(sequences, attention_mask, 8) for role in ("actor", "reference")]

        trainer = types.SimpleNamespace(groups=groups, actor=groups["actor"], placement=placement,
                                        actor_scored_in_update=False, teacher_top_k=None)
        scored = Trainer._log_probs_and_values(trainer, sequences, attention_mask, action_mask)

        assert scored.values is None and scored.teacher is None
        torch.testing.assert_close(scored.actor, one_by_one[0], rtol=0, atol=0)
        torch.testing.assert_close(scored.reference, one_by_one[1], rtol=0, atol=0)

        # DeepSpeed, loaded in every rank, did not import MLflow (installed here: the tracking extra).
        def mlflow_seen(worker):
            from deepspeed.autotuning import autotuner
            return sys.modules.get("mlflow", "never imported"), autotuner.has_mlflow
        seen = ray.get([w.__ray_call__.remote(mlflow_seen) for group in groups.values() for w in group.workers])
        assert seen == [(None, False)] * 2
    finally:
        for group in groups.values():
            for worker in group.workers:
                ray.kill(worker)
        remove_placement_group(bundles)


LOCAL_RAY = textwrap.dedent("""
    import os, sys, tempfile
    import psutil, ray
    from rlhf_trainer.run import _start_local_ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    node = _start_local_ray(2, tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp"))

    @ray.remote(num_cpus=1)
    def task():
        print("printed by a task")  # reaches this process through the log monitor

    ray.get(task.remote())
    names = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    print("PROCESSES", "|".join(names), flush=True)
    ray.shutdown()
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    alive = [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    print("LEFT", len(alive), flush=True)
""")


def test_local_ray_runs_without_dashboard_server_or_autoscaler_monitor():
    run = subprocess.run([sys.executable, "-c", LOCAL_RAY], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    processes = next(line for line in output.splitlines() if line.startswith("PROCESSES")).split("|")
    assert any("gcs_server" in p for p in processes) and any("raylet" in p for p in processes)
    assert any("log_monitor.py" in p for p in processes)
    assert not [p for p in processes if "dashboard/dashboard.py" in p or "autoscaler/_private/monitor.py" in p]
    assert "printed by a task" in output
    assert "LEFT 0" in output


RETRIED_START = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    import ray, ray._private.node
    from rlhf_trainer import run

    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
    first_node, bystander = [], []
    real_init = ray._private.node.Node.__init__

    def slow_first_start(self, *args, **kwargs):  # the first start misses Ray's 30 s, leaving a process behind
        if not first_node:
            quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
            first_node.append(subprocess.Popen([*sleep, temp_dir], **quiet))  # names the temp dir, as Ray's do
            bystander.append(subprocess.Popen(sleep, **quiet))  # started meanwhile by another thread: an image build
            raise Exception("The current node timed out during startup. This could happen because ...")
        real_init(self, *args, **kwargs)

    ray._private.node.Node.__init__ = slow_first_start
    node = run._start_local_ray(1, temp_dir)
    print("FIRST NODE'S PROCESS", first_node[0].wait(timeout=60), "BYSTANDER", bystander[0].poll(), flush=True)
    ray.shutdown()
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    bystander[0].kill()
""")


def test_a_start_that_misses_ray_s_deadline_is_retried_killing_only_that_node_s_processes():
    run = subprocess.run([sys.executable, "-c", RETRIED_START], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "starting it again" in run.stdout
    assert f"FIRST NODE'S PROCESS -{signal.SIGKILL} BYSTANDER None" in run.stdout, run.stdout[-2000:]
