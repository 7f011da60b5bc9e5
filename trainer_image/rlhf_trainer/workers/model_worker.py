"""One rank of a model group, run as a Ray actor: the thin shell Ray calls by method name.

The work lives in the modules it composes: engine.py loads the model into a DeepSpeed engine and
reads it, objectives.py trains it one micro-batch at a time, weights.py gathers its full weights
and weight_sync.py sends them to vLLM. Its methods are the group's remote API, called by name
(ModelGroup, checkpoint.py, weight_sync.py, the trainers): open_rendezvous, setup, forward, score,
train, train_offline, checksums, save_pretrained, weight_shapes, send_weights, open_weight_sync, join_weight_sync,
save_checkpoint and load_checkpoint.

Every rank of a ZeRO-3 group must run the same number of forward passes (each one gathers the
sharded parameters collectively); `ModelGroup` guarantees it by giving ranks equal shards.

A LoRA actor also serves as the reference when there is no models.reference (`forward(base=True)`,
through ModelGroup.base_model_view): the same ranks, adapters switched off.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from rlhf_api.startup import collector_paused
from rlhf_api.v1alpha1 import StepReward

from ..experience import Experience
from ..offline_data import OfflineBatch
from ..rewards.process import read_texts, score_reads
from . import an_actor_s_own_process, weights
from .distributed import COLLECTIVE_TIMEOUT, init_distributed, join_store, node_address, open_store
from .engine import ModelConfig, load_model
from .host_memory import release_after_pass
from .objectives import OFFLINE_STEPS, mean_over_micro_batches, policy_step, value_step
from .packing import longest_first
from .threads import share_the_cores


class ModelWorker:
    def __init__(self, rank: int, world_size: int):
        # DeepSpeed's autotuner imports MLflow wherever it is installed (the image's tracking extra): 1.5 of the
        # ~5 CPU-seconds of each rank's DeepSpeed import, for a tool no rank uses (the trackers report from the
        # driver). None in sys.modules makes that import fail as if MLflow were absent: only in an actor's own
        # process, not in one that runs a rank in-process (a test, the GPU check) and may use MLflow later.
        if an_actor_s_own_process():
            sys.modules.setdefault("mlflow", None)
        self.rank, self.world_size = rank, world_size
        self.store = None  # rank 0: the group's rendezvous, served from open_rendezvous on
        self.sync_store = None  # rank 0: the weight sync's store (open_weight_sync)
        self.sync_targets = []  # where this rank sends the weights (join_weight_sync)

    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: serve the group's rendezvous; returns its address for every rank's `setup`."""
        self.store = open_store(self.world_size, COLLECTIVE_TIMEOUT)
        return node_address(), self.store.port

    def setup(self, cfg: ModelConfig, master_addr: str, master_port: int) -> None:
        # DeepSpeed calls a torch.distributed function torch deprecated, once per step.
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
        torch.manual_seed(cfg.training.seed)
        store = self.store or join_store(master_addr, master_port, self.world_size, COLLECTIVE_TIMEOUT)
        init_distributed(self.rank, self.world_size, store, use_gpu=cfg.use_gpu)
        if not cfg.use_gpu:
            share_the_cores(self.world_size)  # the group's ranks work at once; the other groups wait their turn
        with collector_paused(freeze=an_actor_s_own_process()):  # DeepSpeed's and transformers' imports, the load
            self.model = load_model(cfg, self.rank, self.world_size)

    # -- forward passes --------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, sequences: Tensor, attention_mask: Tensor, num_actions: int, base: bool = False,
                vision: dict[str, Tensor] | None = None) -> Tensor:
        """Log-probs (actor, reference) or values (critic) of the response tokens, [B, T], in eval mode;
        base: of the base model, LoRA adapters off (a LoRA actor serving as the reference); vision: the rows'
        image inputs (a vision-language model's, workers/vision.py)."""
        model = self.model
        read = model.action_values if model.cfg.role == "critic" else model.action_log_probs
        return self._per_micro_batch(read, sequences, attention_mask, num_actions, base, vision)

    @torch.no_grad()
    def top_log_probs(self, sequences: Tensor, attention_mask: Tensor, num_actions: int, k: int) -> tuple[Tensor, Tensor]:
        """The k likeliest tokens at each of the last num_actions positions, their log-probs and ids
        [B, T, k] each, in eval mode (kd's teacher: its distributions, k entries a token)."""
        def top(*batch: Any) -> tuple[Tensor, Tensor]:
            return tuple(self.model.action_logits(*batch).log_softmax(-1).topk(k, dim=-1))

        return self._per_micro_batch(top, sequences, attention_mask, num_actions)

    def _per_micro_batch(self, read: Callable, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                         base: bool = False, vision: dict[str, Tensor] | None = None) -> Tensor | tuple[Tensor, ...]:
        """read(sequences, attention_mask, num_actions) in eval mode over micro-batches (rollout micro size) of
        rows of like lengths (a micro-batch packs to its longest row); its tensor, or tuple of tensors, for
        every row in the order given, on the CPU; base: LoRA adapters off."""
        model = self.model
        micro = model.cfg.training.micro_rollout_batch_size
        order = longest_first(attention_mask)
        outputs = []
        with model.scoring(), model.base_weights() if base else nullcontext():
            for start in range(0, len(order), micro):
                rows = order[start:start + micro]
                images = {} if vision is None else {"vision": {key: t[rows].to(model.device) for key, t in vision.items()}}
                out = read(sequences[rows].to(model.device), attention_mask[rows].to(model.device), num_actions, **images)
                outputs.append(tuple(t.cpu() for t in out) if isinstance(out, tuple) else (out.cpu(),))
        given_order = order.argsort()
        joined = tuple(torch.cat(parts)[given_order] for parts in zip(*outputs))
        del outputs
        release_after_pass()  # the micro-batches' logits, before the next colocated model's turn
        return joined if len(joined) > 1 else joined[0]

    @torch.no_grad()
    def score(self, prompts: list[str], completions: list[str], steps: StepReward | None = None) -> Tensor:
        """Reward model: one reward per prompt + completion [B] (rewards.process.read_texts says what is read:
        the text with eos at its last token; with steps, each step's end, aggregated), cut from the left
        to the model's context; the same as rewards.model.RewardModelScorer for the whole text."""
        model = self.model
        reads = read_texts(model.tokenizer, prompts, completions, steps,
                           model.engine.module.classifier.config.max_position_embeddings)
        rewards = score_reads(lambda ids, mask: model.token_values(ids.to(model.device), mask.to(model.device)).cpu(), reads,
                              model.tokenizer.pad_token_id, model.cfg.training.micro_rollout_batch_size, steps)
        release_after_pass()
        return rewards

    # -- training --------------------------------------------------------------------------------

    def train(self, micro_batches: list[Experience]) -> dict[str, float]:
        """One pass over this rank's micro-batches: the actor's policy_step or the critic's value_step."""
        actor = self.model.cfg.role == "actor"
        metrics = mean_over_micro_batches(self.model, policy_step if actor else value_step, micro_batches)
        metrics["learning_rate" if actor else "critic_learning_rate"] = self.model.learning_rate
        release_after_pass()  # the activations, before the next colocated model's turn
        return metrics | self._grad_norm()

    def train_offline(self, micro_batches: list[OfflineBatch], objective: str, options: dict) -> dict[str, float]:
        """One optimizer step's share of micro-batches on this rank, each trained with
        OFFLINE_STEPS[objective] (offline.Objective.step) and the objective's options."""
        metrics = mean_over_micro_batches(self.model, OFFLINE_STEPS[objective], micro_batches, **options)
        metrics["learning_rate"] = self.model.learning_rate
        release_after_pass()
        return metrics | self._grad_norm()

    def _grad_norm(self) -> dict[str, float]:
        """<role>/grad_norm: the global gradient norm before clipping, averaged over this call's optimizer steps."""
        norm = self.model.take_grad_norm()
        return {} if norm is None else {f"{self.model.cfg.role}/grad_norm": norm}

    # -- weights out (collective: every rank is called) -------------------------------------------

    def release_memory(self) -> None:
        """What the passes and the load left in the caching allocator back to the GPU, for the engines that wake
        on it (the hybrid engine)."""
        release_after_pass()

    def checksums(self) -> dict[str, float]:
        return weights.checksums(self.model)

    def save_pretrained(self, directory: str) -> None:
        weights.save_pretrained(self.model, directory)

    def full_weights(self) -> dict[str, Tensor] | None:
        """The model's whole weights (merged, Hugging Face names) on rank 0, None on the others: what a reference
        refresh (training.referenceRefresh) copies."""
        return weights.state_dict(self.model)

    def blend_weights(self, policy: dict[str, Tensor], alpha: float) -> None:
        """A reference refresh: every weight to alpha * the policy's + (1 - alpha) * its own."""
        weights.blend(self.model, policy, alpha)

    def load_weights(self, directory: str) -> None:
        """The weights save_pretrained wrote to `directory` (a refreshed reference, back from a checkpoint)."""
        from safetensors.torch import load_file

        saved = {name: tensor for file in sorted(Path(directory).glob("*.safetensors"))
                 for name, tensor in load_file(file).items()}
        weights.blend(self.model, saved, 1.0)

    def weight_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, full shape) of each weight the sync sends, in its order (without a gather)."""
        return weights.full_shapes(self.model)

    def send_weights(self, dtype: str, bucket_bytes: int) -> None:
        """Weight sync, sending side (see weight_sync.py): every rank gathers, each sends to its targets."""
        from .weight_sync import send_parameters

        send_parameters(self.model, self.sync_targets, getattr(torch, dtype), bucket_bytes)

    def open_weight_sync(self, world_size: int) -> tuple[str, int]:
        """Rank 0: serve the weight sync's store; returns its address for the other ranks and the vLLM workers."""
        from .weight_sync import SYNC_TIMEOUT

        self.sync_store = open_store(world_size, SYNC_TIMEOUT)
        return node_address(), self.sync_store.port

    def join_weight_sync(self, master_addr: str, master_port: int, world_size: int, routes: list) -> None:
        """This rank's targets for its `routes` (transfer_plan.Route, those it sends): a Handles per
        worker on its device, and on rank 0 rank 0 of the broadcast group when the group has receivers
        (they join meanwhile)."""
        from .transfer_plan import HANDLES
        from .weight_sync import SYNC_TIMEOUT, Handles, SyncGroup, sync_store

        store = sync_store(self.sync_store or join_store(master_addr, master_port, world_size, SYNC_TIMEOUT))
        device = self.model.device
        self.sync_targets = [Handles(store, route, device) for route in routes if route.via == HANDLES]
        if self.rank == 0 and world_size > 1:
            self.sync_targets.append(SyncGroup(store, 0, world_size, device))

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, tag: str) -> None:
        # A LoRA model's frozen base is the model it loads from: the checkpoint holds the adapters only.
        self.model.engine.save_checkpoint(directory, tag=tag, save_latest=False,
                                          exclude_frozen_parameters=self.model.peft is not None)

    def load_checkpoint(self, directory: str, tag: str) -> None:
        path, _ = self.model.engine.load_checkpoint(directory, tag=tag, load_module_strict=self.model.peft is None)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory}")
