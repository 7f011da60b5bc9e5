"""spec.models: the actor, critic, reference and reward models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .base import APIModel, ObjectName, cel



class LoRASpec(APIModel):
    """Train low-rank adapters instead of all weights (Hu et al. 2021, arXiv:2106.09685): the base weights stay
    frozen, vLLM is sent the merged weights after every update, and the final model is exported as the adapter."""

    rank: int = Field(16, ge=1, le=1024)
    """Adapter rank r."""
    alpha: int = Field(32, ge=1)
    """Scaling numerator: adapters are scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=lambda: ["all-linear"], max_length=64
    )
    """Module names to adapt (e.g. q_proj, v_proj), or all-linear: every linear layer but the output head (of a vision-language model, those of its language model: not its vision tower or projector)."""
    modules_to_save: list[Annotated[str, Field(max_length=128)]] = Field(default_factory=list, max_length=64)
    """Modules trained whole beside the adapters (peft's modules_to_save; a name matches every module whose name ends with it), e.g. model.norm: the final norm's gain sets how sharp the output distribution can get, which adapters on the linear layers cannot change."""
    export_merged: bool = False
    """Also export the base model with the adapter merged in, in Hugging Face format, to checkpoint.path/final/merged."""
    quantization: Literal["none", "nf4"] = "none"
    """nf4: QLoRA, the frozen base weights held in 4-bit NormalFloat (Dettmers et al. 2023, arXiv:2305.14314). Needs GPUs (bitsandbytes) and training.zeroStage 2 or lower."""


class PVCSource(APIModel):
    """A PersistentVolumeClaim mounted read-only into every Ray pod."""

    claim_name: ObjectName
    """Name of the PersistentVolumeClaim in the job's namespace."""
    sub_path: str = Field("", max_length=1024)
    """Directory inside the volume that holds the model."""


class JobModelRef(APIModel):
    """The model another RLHFJob of this namespace exported: a pipeline's previous stage (its status.outputModel)."""

    name: ObjectName
    """Name of the RLHFJob, in this job's namespace. This job waits (phase Waiting) until that one has Succeeded, and fails if it fails or is deleted."""
    model: Literal["final", "best"] = "final"
    """final: the model it exported at its end (checkpoint.exportHf); best: its best evaluated checkpoint (spec.evaluation.bestMetric)."""


class ModelSpec(APIModel):
    """A Hugging Face causal LM (actor, reference) or a model with a scalar head (critic, reward)."""

    model_config = cel(
        ("has(self.path) != has(self.fromJob)", "set either path or fromJob (exactly one)"),
        ("!has(self.fromJob) || (!has(self.pvc) && !has(self.revision))",
         "fromJob loads the model from the other job's checkpoint claim: remove pvc and revision", ".fromJob"),
    )

    path: str | None = Field(None, min_length=1, max_length=1024)
    """Hugging Face model id (org/name), or a path inside the container. With pvc set, the path is relative to the volume. Or set fromJob instead."""
    from_job: JobModelRef | None = None
    """The model another RLHFJob exported, instead of path: one stage of a pipeline feeding the next (an sft job's policy for a dpo or ppo actor, an rm job's reward model for models.reward)."""
    revision: str | None = Field(None, max_length=128)
    """Hub revision (branch, tag or commit) for a Hugging Face id."""
    pvc: PVCSource | None = None
    """Load the model from a PersistentVolumeClaim instead of the hub."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Dtype the weights are loaded and trained in (with training.bf16: bfloat16 weights train under DeepSpeed's bf16 with float32 master weights, float32 weights under bfloat16 autocast)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers. flash_attention_2 needs flash-attn, which the default trainer image lacks: it is accepted only with resources.image naming an image that has it. eager trains short samples (under ~100 tokens) faster on CPU: sdpa's CPU kernel costs milliseconds a call in its backward whatever the length (benchmarks/README.md); it holds each layer's attention weights, so keep sdpa for long ones."""
    lora: LoRASpec | None = None
    """Train LoRA adapters instead of full weights (actor and critic only). With a LoRA actor and no models.reference, the reference is the actor's base weights with the adapters switched off: no second copy of the model."""


class ModelsSpec(APIModel):
    """The models of the run. Only the actor is required; the others follow from the algorithm."""

    model_config = cel(*(
        (f"!has(self.{role}) || !has(self.{role}.lora)",
         f"the {role} model is frozen and trains no adapters: remove models.{role}.lora", f".{role}.lora")
        for role in ("reference", "reward", "teacher")
    ))

    actor: ModelSpec
    """The policy being trained (for sft, dpo and rm: the model being fine-tuned)."""
    critic: ModelSpec | None = None
    """Value model for ppo. Defaults to the reward model if there is one, else the actor, with a fresh value head."""
    reference: ModelSpec | None = None
    """Frozen model the KL penalty is measured against. Defaults to the actor's initial weights."""
    reward: ModelSpec | None = None
    """Reward model (sequence classifier with one label) used by reward sources of type model."""
    teacher: ModelSpec | None = None
    """Frozen causal LM that distill distils into the actor: it scores each token the actor samples. It must share the actor's tokenizer (the same vocabulary)."""

    def source(self, role: str) -> tuple[str, ModelSpec]:
        """The field a model group loads: the critic defaults to the reward model, else the actor (with a
        fresh value head); the reference to the actor's initial weights; rm trains the actor field."""
        fallbacks = {"critic": ("critic", "reward", "actor"), "reference": ("reference", "actor"), "rm": ("actor",)}
        for field in fallbacks.get(role, (role,)):
            if (model := getattr(self, field)) is not None:
                return field, model
        raise ValueError(f"spec.models has no model for the {role} group")
