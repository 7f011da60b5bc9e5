"""The typed experience record a rollout produces and the PPO-family update consumes.

Layout of one batch of ``B`` samples:

- ``sequences`` is ``[B, S]``: the prompt, left-padded, followed by the response, right-padded.
- every per-token tensor of the response ("action" tensors) is ``[B, T]`` and covers the last
  ``T`` positions of ``sequences``: action ``t`` is token ``sequences[:, S - T + t]``.
- grouped estimators (GRPO, RLOO, ...) read the batch prompt-major: the ``n`` samples of a prompt
  are adjacent, and ``group_ids`` names the prompt of each sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

_SEQUENCE, _ACTION, _TOP_K, _SAMPLE, _IMAGES = "sequence", "action", "top-k", "sample", "images"


def _sequence():
    """A required ``[B, S]`` field (padded on both sides by ``concat``)."""
    return field(metadata={"kind": _SEQUENCE})


def _action(required: bool = False):
    """A ``[B, T]`` per-response-token field (right-padded by ``concat``)."""
    meta = {"kind": _ACTION}
    return field(metadata=meta) if required else field(default=None, metadata=meta)


def _top_k():
    """An optional ``[B, T, k]`` per-response-token field of k entries (right-padded by ``concat``)."""
    return field(default=None, metadata={"kind": _TOP_K})


def _sample():
    """An optional ``[B]`` per-sample field."""
    return field(default=None, metadata={"kind": _SAMPLE})


def _images():
    """An optional ``[B, N, ...]`` per-sample field of a varying count N (zero-padded by ``concat``)."""
    return field(default=None, metadata={"kind": _IMAGES})


@dataclass
class Experience:
    # [B, S] token ids: the prompt (left-padded) followed by the response (right-padded)
    sequences: Tensor = _sequence()
    # [B, S] 1 on real tokens of sequences, 0 on padding
    attention_mask: Tensor = _sequence()
    # [B, T] True on response tokens that are trained on
    action_mask: Tensor = _action(required=True)
    # [B, T] log-probs of the response tokens under the actor before the update; None when the
    # update's own first forward gives them (one optimizer step per rollout: trainer.actor_scored_in_update)
    action_log_probs: Tensor | None = _action()
    # [B, T] the rollout engine's (vLLM's) sampling log-probs of the response tokens, 0 on
    # observation tokens (training.rolloutCorrectionCap weighs the loss by their gap to action_log_probs)
    rollout_log_probs: Tensor | None = _action()
    # [B, T] log-probs of the response tokens under the frozen reference policy
    base_action_log_probs: Tensor | None = _action()
    # [B, T] critic values V(s_t) at rollout time (gae only)
    values: Tensor | None = _action()
    # [B, T] per-token KL estimate against the reference, unscaled (algorithms.kl)
    kl: Tensor | None = _action()
    # [B, T] advantage of each response token (algorithms.advantages)
    advantages: Tensor | None = _action()
    # [B, T] return targets (the critic's targets for gae)
    returns: Tensor | None = _action()
    # [B, T, k] the teacher's k likeliest next tokens at each response position: their log-probs, and
    # [B, T, k] long their ids (distill with training.distillation.jsdBeta: the divergence in the actor's loss)
    teacher_logps: Tensor | None = _top_k()
    teacher_ids: Tensor | None = _top_k()
    # [B] sequence-level reward of each response
    rewards: Tensor | None = _sample()
    # [B] number of response tokens, action_mask.sum(-1)
    response_length: Tensor | None = _sample()
    # [B] long: index of the prompt each sample answers (grouped estimators)
    group_ids: Tensor | None = _sample()
    # [B] long: valid response tokens of the optimizer step that trains the sample, over all its
    # micro-batches and ranks (workers.group sets it; token-mean divides by it)
    step_tokens: Tensor | None = _sample()
    # Vision-language prompts (workers/vision.py): [B, P, D] each sample's image patches and [B, I, 3] its
    # images' patch grids, zero-padded
    pixel_values: Tensor | None = _images()
    image_grid_thw: Tensor | None = _images()
    # metric name -> [B] per-sample value (reward parts, truncation flags, ...)
    info: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        batch, actions = self.action_mask.shape[0], tuple(self.action_mask.shape)
        if self.sequences.shape != self.attention_mask.shape or self.sequences.shape[0] != batch:
            raise ValueError(
                f"sequences {tuple(self.sequences.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} must be [B, S] with B={batch}"
            )
        if actions[1] > self.sequences.shape[1]:
            raise ValueError(
                f"action tensors cover T={actions[1]} > S={self.sequences.shape[1]} positions"
            )
        for name, kind, value in self._tensors():
            if kind == _ACTION and tuple(value.shape) != actions:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {actions}")
            if kind == _TOP_K and (value.dim() != 3 or tuple(value.shape[:2]) != actions):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {actions + ('k',)}")
            if kind == _SAMPLE and tuple(value.shape) != (batch,):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({batch},)")
            if kind == _IMAGES and (value.dim() < 2 or value.shape[0] != batch):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected ({batch}, N, ...)")

    # -- introspection ------------------------------------------------------------------------

    def _tensors(self) -> Iterator[tuple[str, str, Tensor]]:
        """(name, kind, tensor) for every set tensor field, then ``info`` entries as kind sample."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "info" and value is not None:
                yield f.name, f.metadata["kind"], value
        for key, value in self.info.items():
            yield f"info[{key!r}]", _SAMPLE, value

    @property
    def batch_size(self) -> int:
        return self.action_mask.shape[0]

    @property
    def vision(self) -> dict[str, Tensor] | None:
        """The image inputs of the model's passes (None: a text batch)."""
        return None if self.pixel_values is None else {"pixel_values": self.pixel_values,
                                                       "image_grid_thw": self.image_grid_thw}

    @property
    def num_actions(self) -> int:
        """T, the width of the action tensors."""
        return self.action_mask.shape[1]

    # -- transforms ---------------------------------------------------------------------------

    def _map(self, fn) -> Experience:
        """A new record with ``fn`` applied to every tensor (fields and info)."""
        changes = {
            f.name: fn(getattr(self, f.name))
            for f in fields(self)
            if f.name != "info" and getattr(self, f.name) is not None
        }
        return replace(self, **changes, info={k: fn(v) for k, v in self.info.items()})

    def to(self, device: torch.device | str) -> Experience:
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device))

    def pin_memory(self) -> Experience:
        """A copy with every tensor in pinned host memory (faster host-to-GPU copies)."""
        return self._map(lambda t: t.pin_memory())

    def select(self, index: slice | Tensor) -> Experience:
        """Rows ``index`` of the batch (a slice or a 1-D index tensor)."""
        return self._map(lambda t: t[index])

    def split(self, micro_batch_size: int) -> list[Experience]:
        """Consecutive micro-batches of ``micro_batch_size`` rows (the last may be smaller)."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [
            self.select(slice(i, i + micro_batch_size))
            for i in range(0, self.batch_size, micro_batch_size)
        ]

    @classmethod
    def concat(cls, items: list[Experience], pad_token_id: int = 0) -> Experience:
        """One record from several; widths are aligned by padding.

        Prompts are left-padded to the longest prompt and responses right-padded to the longest
        response, so the action tensors still cover the last ``T`` positions of ``sequences``. The
        records must have the same optional fields and ``info`` keys set.
        """
        if not items:
            raise ValueError("concat needs at least one Experience")
        first = items[0]
        set_names = [name for name, _, _ in first._tensors()]
        for other in items[1:]:
            if [name for name, _, _ in other._tensors()] != set_names:
                raise ValueError("cannot concat experiences with different fields set")
        max_t = max(e.num_actions for e in items)
        max_p = max(e.sequences.shape[1] - e.num_actions for e in items)

        def pad_sequence_part(e: Experience, t: Tensor, value: int) -> Tensor:
            prompt = t.shape[1] - e.num_actions
            return F.pad(t, (max_p - prompt, max_t - e.num_actions), value=value)

        def cat(name: str, kind: str) -> Tensor:
            parts = []
            for e in items:
                t = getattr(e, name)
                if name == "sequences":
                    t = pad_sequence_part(e, t, pad_token_id)
                elif name == "attention_mask":
                    t = pad_sequence_part(e, t, 0)
                elif kind == _ACTION:  # [B, T]
                    t = F.pad(t, (0, max_t - e.num_actions), value=0)
                elif kind == _TOP_K:  # [B, T, k]
                    t = F.pad(t, (0, 0, 0, max_t - e.num_actions), value=0)
                elif kind == _IMAGES:  # [B, N, ...]
                    most = max(getattr(other, name).shape[1] for other in items)
                    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, most - t.shape[1]), value=0)
                parts.append(t)
            return torch.cat(parts, dim=0)

        changes = {
            f.name: cat(f.name, f.metadata["kind"])
            for f in fields(cls)
            if f.name != "info" and getattr(first, f.name) is not None
        }
        info = {k: torch.cat([e.info[k] for e in items], dim=0) for k in first.info}
        return replace(first, **changes, info=info)
