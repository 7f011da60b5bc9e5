"""What each GPU and each worker pod of a job holds, phase by phase, estimated from the models' configs before
anything loads.

The trainer's order of calls is the plan's (rlhf_trainer/trainer.py): on shared GPUs vLLM's engines start first and
sleep while the models load; each step the engines sample and a reward model scores the samples (phase
"generate": the engines are still awake), then the engines sleep while the models score the rollout one after
another ("score") and train one after another ("train"), each process handing its caching allocator's blocks
back after its pass (rlhf_trainer/workers/model_worker.py); then the engines wake their weights, take the sync,
and only then their KV cache. A job whose busiest GPU, or whose worker pod, cannot hold a phase is refused before any model loads.

The terms, per process on a GPU (bytes), and how each is calibrated:
- weights: parameters (counted from config.json: exact for the architectures in _layer_params, tested against
  transformers' own models) x the dtype's bytes, split over the group's ranks under ZeRO-3;
- training.tensorParallel N (the actor and critic, split_size): each rank holds 1/N of the layers' linear weights
  and biases (Shape.split_params: what DeepSpeed's AutoTP splits, the embedding, head and norms whole), and its
  gradients and AdamW state of that share are split by ZeRO over the data-parallel ranks, ranks / N. Exact (the
  shard shapes AutoTP made of the tiny model, tests/trainer/test_tensor_parallel.py); after the step the actor's
  weight sync gathers a bucket's layers whole: 3 buckets of rollout.weightSyncBucketMib (the API's count: the
  gathered bucket, its flattened copy, one a worker has not taken), a weight larger than a bucket alone, charged
  instead of the step's activations (freed by then). Estimated from the sync's code (workers/weights.py);
- a trained model's gradients (its dtype, split from ZeRO-2) and AdamW's state (the fp32 copy of the weights
  ZeRO's optimizer steps, kept even of float32 weights, and two fp32 moments: 12 bytes a parameter, 8 for
  float32 weights at ZeRO-0, stepped in place; split from ZeRO-1; none with offloadOptimizer);
  LoRA trains adapters only, whose state is counted as nothing. Exact (byte counts of DeepSpeed's partitions);
- at the optimizer step of 16-bit weights, the fp32 gradient partition DeepSpeed steps from (4 bytes a
  parameter, split from ZeRO-1): estimated from DeepSpeed's optimizer code, charged instead of the
  activations (they are freed by then), not beside them;
- under ZeRO-3 with several ranks, the whole parameters each pass gathers: DeepSpeed's defaults keep up to
  stage3_max_live_parameters (1e9) plus a stage3_prefetch_bucket_size (5e7) of them live, the whole model if
  smaller. Estimated from DeepSpeed's defaults (the config leaves them as they are);
- activations of one micro-batch of full-length sequences: the logits of the response positions only (the
  forward keeps only those, logits_to_keep): 12 bytes an element when scoring (the model's logits, their
  float32 copy at the sampling temperature, the log-softmax) and 16 when training (their gradients too), and
  the layers' own: about 34 x tokens x hidden bytes per layer in 16 bits (Korthikanti et al. 2022,
  arXiv:2205.05198, with a fused attention), or only each layer's input and one layer's working set with
  gradient checkpointing. Upper bounds: packing and shorter samples hold less. Estimated; the one-GPU check
  (benchmarks/gpu_check.py) measured a 39M-parameter ZeRO-3 step at 0.66-0.9x of the plan;
- training.sequenceParallel N (every model, rlhf_trainer/workers/sequence_parallel.py): each rank runs the layers
  on 1/N of the micro-batch's tokens (rounded up), so the layers' activations are divided by N, and it computes the
  logits of its own columns only: at most the response positions, at most its 1/N of the tokens (a long answer
  fills the last ranks' columns; the teacher's top-k reads the logits gathered whole, so its term stays whole).
  ZeRO still shards over all the group's ranks (DeepSpeed's sequence-data-parallel group). On top, per rank: one
  layer's all-to-all buffers, its q, k, v and attention output cut into pieces and received (2 x (2 x hidden + 2 x
  key-value width) x its tokens x the dtype's bytes; q's width taken as hidden), and the whole rows' attention
  mask the sdpa and eager kernels read (rows x row length squared, 1 byte for sdpa's booleans, the dtype's for
  eager's additive mask; none for flash-attention, which reads the samples from the position ids). Estimated from
  the module's code: what the all-to-alls and the mask allocate;
- a vision-language model (Shape.vision): its vision tower and projector among the weights (VisionShape: exact for
  Qwen2-VL and Qwen2.5-VL); with training.freezeVisionTower the tower has no gradients or optimizer state; each
  pass adds the tower's activations over the rows' image patches (image tokens x spatial_merge_size squared, the
  image tokens bounded by data.maxPromptTokens, which a prompt with images never exceeds): one block's working set
  at a time, every block's when the tower trains. The image tokens themselves are the row's tokens, already
  counted. Estimated as the language model's layers are;
- a vLLM worker: its CUDA context always (its own process), and while awake gpuMemoryUtilization x the GPU on
  top, all of it its weights, activations and KV cache (vLLM sizes the cache to fill its share); asleep nothing
  more (level 1 before the first rollout, its weights in pinned host memory; level 2 in the loop);
- CUDA_CONTEXT per process: the CUDA context, cuBLAS workspace and NCCL buffers of a one-rank group, as
  benchmarks/gpu_check.py measured them (a process's GPU memory less what torch's allocator reserved): 1.30 GiB
  on an H200 with torch 2.11 / CUDA 13 (2026-11-27); NCCL_PEERS more in each process of a group with several
  ranks (NCCL's per-peer channel buffers: estimated from NCCL's defaults, 4 MiB buffers x up to 32 channels x
  send and receive x its protocols);
- DEEPSPEED_BUFFERS per trained rank and per 2 bytes of each dtype it reduces gradients in: what DeepSpeed's
  engine allocates beyond the weights, gradients and optimizer state (its reduce bucket, 5e8 elements by
  default, sized by its defaults rather than by the model), as benchmarks/gpu_check.py measured it: a
  39M-parameter model's ZeRO-3 bf16 step peaked at 1.73 GiB allocated where the rest of the plan counts 0.84,
  and a 0.34M-parameter one's at 1.00 GiB (H200, 2026-11-27); the 39M model's float32 weights under bf16
  autocast at 3.74 GiB (2026-11-28): a bucket for the linear layers' bfloat16 gradients and one for the rest's
  float32, 1 + 2 GiB (`deepspeed_buffers`).

Host memory, per worker pod (its GPUs' processes together, against resources.worker_memory):
- HOST_PROCESS per process (a model rank or a vLLM worker): Python, torch, CUDA's host-side libraries, Ray's
  worker: estimated at 3 GiB (a CPU rank here measures 0.6 GiB without CUDA's libraries);
- vLLM's pinned copy of its weights while it sleeps at level 1 (the hybrid engine, before the first rollout):
  the actor's parameters x the engine dtype / its tensor-parallel width, per worker. Exact;
- offloadOptimizer: DeepSpeed's CPU partition of fp32 master weights, moments and gradients, 16 bytes a
  parameter split over the ranks. Exact;
- /dev/shm, memory-backed and counted in the pod's limit: resources.shmSize, whole (NCCL, vLLM and Ray's
  object store write there).

What the plan leaves out: the caching allocator's fragmentation, and host memory while a model loads (read
from the safetensors files' shared page cache). Treat a phase within a few GiB of the GPU's size as not fitting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from rlhf_api.algorithms import CAUSAL_LM_ROLES, TRAINED_ROLES
from rlhf_api.paths import is_hub_id, model_path
from rlhf_api.v1alpha1 import RLHFJobSpec
from rlhf_api.v1alpha1.base import quantity_bytes
from rlhf_api.v1alpha1.data import PREFERENCES
from rlhf_api.validation import FieldError, InvalidJob

from .placement import ROLLOUT, Placement, plan_placement

GIB = 1 << 30
CUDA_CONTEXT = 13 * GIB // 10  # measured, see above
NCCL_PEERS = GIB // 2  # estimated, see above
DEEPSPEED_BUFFERS = GIB  # per 2 bytes of a gradient dtype: measured 0.89 and 0.99 GiB in bfloat16, see above
ZERO3_LIVE_PARAMETERS = 1_000_000_000 + 50_000_000  # DeepSpeed's max live parameters and prefetch bucket
HOST_PROCESS = 3 * GIB  # estimated, see above
LOGIT_BYTES = {False: 12, True: 16}  # per logit element, scoring / training (see above)
# nvidia.com/gpu.product label -> the memory nvidia-smi reports (MiB)
GPU_MEMORY_MIB = {
    "NVIDIA-H100-80GB-HBM3": 81559, "NVIDIA-H100-NVL": 95830, "NVIDIA-H200": 143771,
    "NVIDIA-A100-SXM4-80GB": 81920, "NVIDIA-A100-SXM4-40GB": 40960, "NVIDIA-A100-80GB-PCIe": 81920,
    "NVIDIA-L40S": 46068, "NVIDIA-A10G": 23028, "NVIDIA-L4": 23034,
}
# The names people type -> the product label (case does not matter)
GPU_NAMES = {
    "H100": "NVIDIA-H100-80GB-HBM3", "H100-80GB": "NVIDIA-H100-80GB-HBM3", "H100-NVL": "NVIDIA-H100-NVL",
    "H200": "NVIDIA-H200", "A100-80GB": "NVIDIA-A100-SXM4-80GB", "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB-PCIE": "NVIDIA-A100-80GB-PCIe", "L40S": "NVIDIA-L40S", "A10G": "NVIDIA-A10G", "L4": "NVIDIA-L4",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
PHASES = ("generate", "score", "train")
ENGINE = "vLLM worker"
# The roles training.tensorParallel splits; the reference, reward and teacher hold no gradients or optimizer state
# and stay whole (rlhf_trainer/workers/tensor_parallel.py says why).
TRAINED_WITH_AUTOTP = ("actor", "critic")


def gpu_label(gpu: str) -> str:
    """The nvidia.com/gpu.product label of a GPU named by its label or by a name people type (H100, A100-80GB)."""
    return GPU_NAMES.get(gpu.upper(), gpu)


def gpu_bytes(gpu: str) -> int:
    """A GPU's memory from its product label (GPU_MEMORY_MIB), a name (GPU_NAMES) or a size such as 80GiB."""
    if gpu_label(gpu) in GPU_MEMORY_MIB:
        return GPU_MEMORY_MIB[gpu_label(gpu)] << 20
    if gpu.endswith("GiB") and gpu[:-3].replace(".", "", 1).isdigit():
        return int(float(gpu[:-3]) * GIB)
    raise ValueError(f"unknown GPU {gpu!r}: name a size such as 80GiB, one of {', '.join(GPU_NAMES)}, or a product "
                     f"label: {', '.join(GPU_MEMORY_MIB)}")


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a model: its parameters and the sizes its activations and KV cache scale with."""

    params: int
    layers: int
    hidden: int
    vocab: int
    kv_bytes_per_token: int  # keys and values of every layer, per token, in 16 bits
    split_params: int = 0  # what AutoTP splits (training.tensorParallel): the layers' linear weights and biases
    largest_weight: int = 0  # parameters of the largest of those weights (a gathered one travels whole)
    vision: VisionShape | None = None  # a vision-language model's tower and projector (counted in params too)

    @classmethod
    def from_config(cls, config: dict, value_head: bool = False) -> Shape:
        """From a Hugging Face config.json; value_head: a sequence classifier with one label (critic, reward). A
        vision-language model's (its vision_config) adds its vision tower and projector (VisionShape)."""
        if "vision_config" in config:
            vision = VisionShape.from_config(config)
            language = {key: value for key, value in config.get("text_config", config).items() if key != "vision_config"}
            text = Shape.from_config({**language, "model_type": TEXT_MODEL_TYPES[config["model_type"]],
                                      "tie_word_embeddings": config.get("tie_word_embeddings", False)}, value_head)
            return replace(text, params=text.params + vision.tower_params + vision.projector_params, vision=vision)
        text = config.get("text_config", config)
        hidden = text.get("hidden_size") or text["n_embd"]
        layers = text.get("num_hidden_layers") or text["n_layer"]
        heads = text.get("num_attention_heads") or text["n_head"]
        kv_heads = text.get("num_key_value_heads") or heads
        head_dim = text.get("head_dim") or hidden // heads
        vocab = text["vocab_size"]
        params = layers * _layer_params(text, hidden, heads, kv_heads, head_dim) + vocab * hidden + _final_norm(text, hidden)
        if text.get("model_type") == "gpt2":
            params += text["n_positions"] * hidden  # learned positions
        if value_head:
            params += hidden  # the score head, one label, no bias
        elif not text.get("tie_word_embeddings", True):
            params += vocab * hidden
        norms = _final_norm(text, hidden) if text.get("model_type") == "gpt2" else 2 * hidden  # a layer's own
        largest = hidden * max(text.get("intermediate_size") or text.get("n_inner") or 4 * hidden, heads * head_dim)
        return cls(params, layers, hidden, vocab, layers * 2 * kv_heads * head_dim * 2,
                   layers * (_layer_params(text, hidden, heads, kv_heads, head_dim) - norms), largest)


def head_counts(config: dict) -> dict[str, int | None]:
    """A config.json's attention heads and key-value heads (fewer under grouped-query attention), named for a
    message; a vision-language model's are its language model's. What a split of the heads must divide."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    return {"attention heads": heads, "key-value heads": text.get("num_key_value_heads", heads)}


# A vision-language model's language model, by the model's model_type: the text layout _layer_params counts.
TEXT_MODEL_TYPES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2"}


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's vision tower (patch embedding and blocks: what training.freezeVisionTower freezes)
    and its projector (the merger into the language model's width), counted from config.json's vision_config:
    exact for Qwen2-VL's and Qwen2.5-VL's (tested against transformers' models)."""

    tower_params: int
    projector_params: int
    width: int  # a patch's width through the blocks
    depth: int  # blocks
    merge: int  # patches per image token (spatial_merge_size squared)

    @classmethod
    def from_config(cls, config: dict) -> VisionShape:
        kind, vision = config["model_type"], config["vision_config"]
        if kind not in TEXT_MODEL_TYPES:
            raise ValueError(f"model_type {kind!r}: the memory plan counts the vision-language models "
                             f"{', '.join(TEXT_MODEL_TYPES)}")
        merge = vision.get("spatial_merge_size", 2)
        channels = vision.get("in_channels") or vision.get("in_chans", 3)
        if kind == "qwen2_vl":  # LayerNorms with biases, a plain MLP of mlp_ratio
            width = vision["embed_dim"]
            inner, out, norm = width * vision.get("mlp_ratio", 4), vision["hidden_size"], 2 * width
            mlp = 2 * width * inner + inner + width
        else:  # qwen2_5_vl: RMSNorms, a gated MLP with biases
            width, inner, out = vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]
            norm = width
            mlp = 3 * width * inner + 2 * inner + width
        block = 2 * norm + (width * 3 * width + 3 * width) + (width * width + width) + mlp
        patch = channels * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2 * width
        merged = width * merge * merge
        projector = norm + (merged * merged + merged) + (merged * out + out)
        return cls(vision["depth"] * block + patch, projector, width, vision["depth"], merge * merge)


def _layer_params(text: dict, hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    kind = text.get("model_type")
    if kind == "gpt2":  # fused qkv and MLP with biases, two LayerNorms
        inner = text.get("n_inner") or 4 * hidden
        return (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) + 2 * (hidden * inner) + inner + hidden + 4 * hidden
    if kind not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"model_type {kind!r}: the memory plan counts llama, mistral, qwen2, qwen3 and gpt2 models")
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    if kind == "qwen2":
        attention += q + 2 * kv  # q, k and v biases
    if kind == "qwen3":
        attention += 2 * head_dim  # q and k norms
    return attention + 3 * hidden * text["intermediate_size"] + 2 * hidden  # gated MLP, two RMSNorms


def _final_norm(text: dict, hidden: int) -> int:
    return 2 * hidden if text.get("model_type") == "gpt2" else hidden


@dataclass
class Process:
    """One process's share of a GPU: what it holds throughout, its peak on top in each phase, and its host memory."""

    name: str
    held: dict[str, int] = field(default_factory=dict)  # what -> bytes, all phases
    extra: dict[str, int] = field(default_factory=dict)  # phase -> bytes on top of `held`, while it runs
    host: dict[str, int] = field(default_factory=dict)  # what -> bytes of host memory at its peak

    @property
    def resident(self) -> int:
        return sum(self.held.values()) + CUDA_CONTEXT


@dataclass
class GPUPlan:
    index: int
    processes: list[Process]
    engine_share: float  # of the GPU's memory an awake engine worker here claims (0: none here)

    def phase(self, name: str, total: int) -> int:
        """Bytes in use during a phase: every process's resident memory, an awake engine's share while it
        generates, and the largest of the passes that take turns here."""
        engine = self.engine_share * total if name == "generate" else 0
        return sum(p.resident for p in self.processes) + int(engine) + max(
            (p.extra.get(name, 0) for p in self.processes), default=0)

    def host(self) -> dict[str, int]:
        """Host memory of this GPU's processes, by what."""
        kinds: dict[str, int] = {}
        for process in self.processes:
            for what, n in process.host.items():
                kinds[what] = kinds.get(what, 0) + n
        return kinds


@dataclass
class MemoryPlan:
    gpu: str
    total: int
    gpus: list[GPUPlan]
    kv_sequences: int | None  # full-length sequences an engine's KV cache holds at once (None: no engines)
    notes: list[str]
    gpus_per_pod: int = 1
    shm: int = 0  # each worker pod's /dev/shm
    pod_limit: int | None = None  # each worker pod's memory limit (None: not checked)

    def peak(self) -> tuple[GPUPlan, str, int]:
        return max(((g, phase, g.phase(phase, self.total)) for g in self.gpus for phase in PHASES), key=lambda t: t[2])

    def pod_host(self) -> tuple[int, dict[str, int]]:
        """The busiest worker pod's host memory: (pod index, what -> bytes), its GPUs' processes and /dev/shm."""
        pods: list[dict[str, int]] = []
        for start in range(0, len(self.gpus), self.gpus_per_pod):
            kinds = {"/dev/shm": self.shm}
            for gpu in self.gpus[start:start + self.gpus_per_pod]:
                for what, n in gpu.host().items():
                    kinds[what] = kinds.get(what, 0) + n
            pods.append(kinds)
        index = max(range(len(pods)), key=lambda i: sum(pods[i].values()))
        return index, pods[index]

    @property
    def host_fits(self) -> bool:
        return self.pod_limit is None or sum(self.pod_host()[1].values()) <= self.pod_limit

    @property
    def fits(self) -> bool:
        return (self.peak()[2] <= self.total and (self.kv_sequences is None or self.kv_sequences >= 1)
                and self.host_fits)

    def render(self) -> str:
        gib = lambda n: f"{n / GIB:.1f}"  # noqa: E731
        lines = [f"GPU {self.gpu}: {gib(self.total)} GiB each; GiB per GPU and phase ({', '.join(PHASES)})"]
        for plan in _distinct(self.gpus):
            phases = "  ".join(f"{phase} {gib(plan.phase(phase, self.total)):>6}" for phase in PHASES)
            lines.append(f"  GPU {plan.index}: {phases}")
            for process in plan.processes:
                held = "".join(f"{what} {gib(n)}, " for what, n in process.held.items())
                extra = ", ".join(f"{phase} +{gib(n)}" for phase, n in process.extra.items())
                lines.append(f"    {process.name}: {held}context {gib(CUDA_CONTEXT)}" + (f"; {extra}" if extra else ""))
            if plan.engine_share:
                lines.append(f"    vLLM worker awake: {plan.engine_share:g} of the GPU ({gib(plan.engine_share * self.total)})")
        if self.kv_sequences is not None:
            lines.append(f"  KV cache per engine: {self.kv_sequences} full-length sequences at once")
        plan, phase, used = self.peak()
        gpu_fits = used <= self.total and (self.kv_sequences is None or self.kv_sequences >= 1)
        lines.append(f"  peak: GPU {plan.index} in {phase}, {gib(used)} of {gib(self.total)} GiB: "
                     + ("fits" if gpu_fits else "DOES NOT FIT"))
        pod, host = self.pod_host()
        limit = "" if self.pod_limit is None else f" of {gib(self.pod_limit)} GiB (resources.worker.memory)"
        verdict = "" if self.pod_limit is None else (": fits" if self.host_fits else ": DOES NOT FIT")
        lines.append(f"  host memory of worker pod {pod} ({self.gpus_per_pod} GPUs): "
                     + ", ".join(f"{what} {gib(n)}" for what, n in host.items())
                     + f"; {gib(sum(host.values()))} GiB{limit}{verdict}")
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


def _distinct(gpus: list[GPUPlan]) -> list[GPUPlan]:
    """One GPU of each layout (GPUs holding the same processes print once)."""
    seen, kept = set(), []
    for plan in gpus:
        key = (tuple((p.name.split(" rank")[0], tuple(p.held.items()), tuple(p.extra.items())) for p in plan.processes),
               plan.engine_share)
        if key not in seen:
            seen.add(key)
            kept.append(plan)
    return kept


def deepspeed_buffers(dtype_bytes: int, autocast: bool) -> int:
    """DeepSpeed's reduce bucket in each dtype it reduces gradients in: the weights', and also bfloat16 when
    training.bf16 autocasts float32 weights (its linear layers' gradients travel in bfloat16)."""
    reduced = [dtype_bytes] + ([2] if autocast else [])
    return sum(DEEPSPEED_BUFFERS * size // 2 for size in reduced)


def plan_memory(spec: RLHFJobSpec, placement: Placement, shapes: dict[str, Shape], gpu: str) -> MemoryPlan:
    """The job's memory on each GPU (bundle) of its placement; shapes: role -> Shape (Shape.from_config)."""
    total, training = gpu_bytes(gpu), spec.training
    online = bool(placement.ranks.get(ROLLOUT))
    preference = 2 if spec.algorithm in PREFERENCES else 1  # chosen and rejected rows in one pass
    sequence = (spec.data.max_prompt_tokens + spec.rollout.max_new_tokens if online else spec.data.max_tokens) * preference
    # The logits of the response positions only (logits_to_keep); offline rows' responses may fill the row.
    response = (spec.rollout.max_new_tokens + 1 if online else spec.data.max_tokens) * preference
    hybrid = placement.engines_colocated
    prompt = spec.data.max_prompt_tokens if online else spec.data.max_tokens  # a row's image tokens, at most
    gpus = [GPUPlan(i, [], 0.0) for i in range(placement.bundles)]
    for role, bundles in placement.ranks.items():
        if role == ROLLOUT:
            continue
        model = _model_spec(spec, role)
        shape, dtype = shapes[role], DTYPE_BYTES[model.dtype]
        tensor_parallel = split_size(role, training)
        ranks = len(bundles) // tensor_parallel  # ZeRO splits over the data-parallel ranks
        split = lambda stage: ranks if training.zero_stage >= stage else 1  # noqa: E731
        params = shape.params - shape.split_params + shape.split_params // tensor_parallel  # this rank's share
        held = {"weights": params * dtype // split(3)}
        host = {"process": HOST_PROCESS}
        trained = role in TRAINED_ROLES and model.lora is None
        frozen_tower = shape.vision is not None and training.freeze_vision_tower
        learnt = params - (shape.vision.tower_params if frozen_tower else 0)  # what has gradients and optimizer state
        step = 0  # the optimizer step's own memory, once the activations are freed
        if trained:
            held["gradients"] = learnt * dtype // split(2)
            if training.offload_optimizer:
                host["optimizer (offloaded)"] = learnt * 16 // split(1)
            else:
                held["optimizer"] = learnt * (8 if dtype == 4 and training.zero_stage == 0 else 12) // split(1)
                step = learnt * 4 // split(1) if dtype == 2 else 0
            held["deepspeed buffers"] = deepspeed_buffers(dtype, training.autocasts(model.dtype))
        if len(bundles) > 1:
            held["NCCL peers"] = NCCL_PEERS
        gathered = min(shape.params, ZERO3_LIVE_PARAMETERS) * dtype if training.zero_stage == 3 and ranks > 1 else 0
        extra = {}
        pass_of = SplitPass(training.sequence_parallel.size, sequence, response, role, model.attn_implementation, dtype)
        if online or role == "reference":  # rollouts are scored by every model; dpo's reference reads each batch
            batch = training.micro_rollout_batch_size if online else training.micro_train_batch_size
            # A reward model scores while the hybrid engine is still awake (trainer._scored, before it sleeps).
            phase = "generate" if role == "reward" and hybrid else "score"
            extra[phase] = gathered + pass_of.activations(shape, batch, False, False) + _tower_pass(shape, batch, prompt, False)
        if role in TRAINED_ROLES:
            micro = training.micro_train_batch_size
            tower = _tower_pass(shape, micro, prompt, not frozen_tower)
            extra["train"] = max(step, gathered + pass_of.activations(shape, micro, True, model.gradient_checkpointing) + tower)
            if role == "actor" and online and tensor_parallel > 1:  # the sync's gather, after the step
                extra["train"] = max(extra["train"], _sync_gather(spec, shape))
        for rank, bundle in enumerate(bundles):
            gpus[bundle].processes.append(Process(f"{role} rank {rank}", held, extra, host))
    kv_sequences = None
    if online:
        share, width = spec.engine_memory_utilization, placement.engine_width
        actor = shapes["actor"]
        engine_weights = actor.params * DTYPE_BYTES[spec.engine_dtype] // width
        for bundle in sorted(placement.bundles_of(ROLLOUT)):
            gpus[bundle].engine_share = share
            # asleep at level 1 (the hybrid engine, before the first rollout): its weights pinned on the host
            host = {"process": HOST_PROCESS} | ({"vLLM weights asleep (pinned)": engine_weights} if hybrid else {})
            gpus[bundle].processes.append(Process(ENGINE, {"NCCL peers": NCCL_PEERS} if width > 1 else {}, {}, host))
        kv = share * total - engine_weights - CUDA_CONTEXT
        kv_sequences = max(0, int(kv * width // (actor.kv_bytes_per_token * sequence)))
    notes = []
    if hybrid:
        notes.append("vLLM starts before the models load and must find its share free: the models' resident "
                     "memory and its share together must fit (the generate column)")
    if any(_model_spec(spec, role).lora is not None for role in placement.ranks if role in TRAINED_ROLES):
        notes.append("LoRA adapters' weights, gradients and optimizer state are not counted (megabytes)")
    resources = spec.resources
    return MemoryPlan(gpu_label(gpu), total, gpus, kv_sequences, notes, gpus_per_pod=max(resources.gpus_per_node, 1),
                      shm=quantity_bytes(resources.shm_size), pod_limit=quantity_bytes(resources.worker_memory))


def split_size(role: str, training) -> int:
    """The ranks training.tensorParallel splits `role`'s layers over (1: whole), for this plan and the trainer
    (rlhf_trainer/workers/tensor_parallel.py); training is a TrainingSpec."""
    return training.tensor_parallel.size if role in TRAINED_WITH_AUTOTP else 1


def ranks_per_copy(role: str, training) -> int:
    """The consecutive ranks of `role`'s group that read the same rows: a tensor-parallel split (split_size) or a
    sequence-parallel group (training.sequenceParallel.size, every role); the data-parallel degree is the group's
    ranks over it. The API refuses both at once."""
    return split_size(role, training) * training.sequence_parallel.size


def _sync_gather(spec: RLHFJobSpec, shape: Shape) -> int:
    """A split actor's weight sync: the layers of a bucket gathered whole, in the engine's dtype, up to 3 buckets of
    rollout.weightSyncBucketMib held at once (the API's count), a weight larger than a bucket alone."""
    bucket = max(spec.rollout.weight_sync_bucket_mib << 20, shape.largest_weight * DTYPE_BYTES[spec.engine_dtype])
    return 3 * bucket


def _model_spec(spec: RLHFJobSpec, role: str):
    return spec.models.source(role)[1]


@dataclass(frozen=True)
class SplitPass:
    """One rank's share of a micro-batch's pass, its rows split over training.sequenceParallel.size ranks (1: whole);
    see the module's docstring."""

    size: int
    sequence: int  # tokens of a row
    response: int  # its positions whose logits are read
    role: str
    attention: str  # the model's attnImplementation
    dtype: int  # bytes of the model's dtype

    def activations(self, shape: Shape, rows: int, training: bool, checkpointing: bool) -> int:
        tokens = -(-rows * self.sequence // self.size)
        logits = rows * self.response if self.role == "teacher" else min(rows * self.response, tokens)
        return _activations(shape, tokens, logits, self.role, training, checkpointing) + self.buffers(shape, rows, tokens)

    def buffers(self, shape: Shape, rows: int, tokens: int) -> int:
        """The all-to-all's pieces and what it receives, and the whole rows' mask (none unsplit)."""
        if self.size == 1:
            return 0
        kv_width = shape.kv_bytes_per_token // (shape.layers * 4)  # keys' width (kv_bytes_per_token: k and v, 16 bits)
        all_to_all = 2 * (2 * shape.hidden + 2 * kv_width) * tokens * self.dtype
        mask = rows * self.sequence ** 2 * MASK_BYTES.get(self.attention, self.dtype)
        return all_to_all + (0 if self.attention.startswith("flash") else mask)


MASK_BYTES = {"sdpa": 1, "flash_attention_2": 0}  # per element of the whole rows' mask; eager's is the dtype's


def _activations(shape: Shape, tokens: int, logit_tokens: int, role: str, training: bool, checkpointing: bool) -> int:
    """Bytes of one micro-batch's pass (see the module's docstring): `tokens` through the layers, the logits of
    `logit_tokens`."""
    logits = logit_tokens * shape.vocab * LOGIT_BYTES[training] if role in CAUSAL_LM_ROLES else 0  # value heads: none
    layer = 34 * tokens * shape.hidden
    if not training:
        return logits + layer  # one layer's working set at a time
    layers = shape.layers * tokens * shape.hidden * 2 + layer if checkpointing else shape.layers * layer
    return logits + layers


def _tower_pass(shape: Shape, rows: int, image_tokens: int, trained: bool) -> int:
    """Bytes of a micro-batch's pass through a vision-language model's tower: `rows` rows of at most image_tokens
    image tokens each (a prompt with images is never cut: data.maxPromptTokens bounds them), merge patches a token,
    through one block at a time (34 x patches x width bytes, 16 bits, as the language model's layers), or every
    block when the tower trains (freezeVisionTower false: their activations kept for the backward pass)."""
    if shape.vision is None:
        return 0
    patches = rows * image_tokens * shape.vision.merge
    return 34 * patches * shape.vision.width * (shape.vision.depth if trained else 1)


def shapes_of(spec: RLHFJobSpec, placement: Placement, config_of) -> dict[str, Shape]:
    """role -> Shape for every model group and the engines' actor; config_of(role) -> config.json's dict."""
    roles = {role for role in placement.ranks if role != ROLLOUT} | {"actor"}
    return {role: Shape.from_config(config_of(role), value_head=role not in CAUSAL_LM_ROLES) for role in roles}


def local_config(models_dir: Path | None, base_dir: Path, spec: RLHFJobSpec, fetch: bool = False):
    """config_of(role) for shapes_of: config.json from the model's directory (a local path), else from
    models_dir/<hub id>/config.json (a directory laid out like the hub, such as manifests/examples/model-configs),
    else, with fetch, the hub's config.json alone (at the model's revision, through the Hugging Face cache: the
    trainer's, which has huggingface_hub; `rlhf validate --gpu` never fetches)."""
    def config_of(role: str) -> dict:
        model = _model_spec(spec, role)
        local = Path(model_path(spec.models, role, base_dir))
        candidates = [local / "config.json"]
        if models_dir is not None:
            candidates.append(models_dir / model.path / "config.json")
        for candidate in candidates:
            if candidate.is_file():
                return json.loads(candidate.read_text())
        if fetch and is_hub_id(str(local)):
            from huggingface_hub import hf_hub_download

            return json.loads(Path(hf_hub_download(model.path, "config.json", revision=model.revision)).read_text())
        raise FileNotFoundError(f"no config.json for the {role}'s model {model.path} (looked at "
                                f"{', '.join(map(str, candidates))}): pass --model-configs DIR holding "
                                f"{model.path}/config.json")

    return config_of


def refuse_unless_fits(plan: MemoryPlan) -> None:
    """InvalidJob with the plan's numbers and what to change, when a phase of a GPU, or a worker pod's host
    memory, does not fit."""
    if plan.fits:
        return
    gpu, phase, used = plan.peak()
    errors = []
    if plan.kv_sequences == 0:
        errors.append(("spec.resources", "vLLM's share of each GPU (rollout.gpuMemoryUtilization) leaves no room for "
                       "one full-length sequence's KV cache after the actor's weights: raise it, or "
                       "rollout.tensorParallelSize"))
    elif used > plan.total:
        errors.append(("spec.resources", f"GPU {gpu.index} would hold {used / GIB:.1f} GiB of {plan.total / GIB:.1f} "
                       f"GiB while the job {'samples' if phase == 'generate' else 'scores' if phase == 'score' else 'trains'}. "
                       "To fit: zeroStage 3, offloadOptimizer, gradientCheckpointing, smaller micro-batches, a lower "
                       "rollout.gpuMemoryUtilization, or more GPUs"))
    if not plan.host_fits:
        pod, host = plan.pod_host()
        needed = sum(host.values())
        errors.append(("spec.resources.worker.memory", f"worker pod {pod} would hold {needed / GIB:.1f} GiB of host "
                       f"memory (its GPUs' processes and /dev/shm) in a limit of {plan.pod_limit / GIB:.1f} GiB: set "
                       f"resources.worker.memory to {-(-needed // GIB)}Gi or more, or a smaller resources.shmSize"))
    raise InvalidJob([FieldError(path, f"the job does not fit {plan.gpu}: {problem}.\n{plan.render()}")
                      for path, problem in errors])


def plan_job(spec: RLHFJobSpec, gpu: str, config_of) -> MemoryPlan:
    """The plan of a GPU job (resources.gpusPerNode > 0) on GPUs of this kind (gpu_bytes)."""
    placement = plan_placement(spec, use_gpu=True)
    return plan_memory(spec, placement, shapes_of(spec, placement, config_of), gpu)
