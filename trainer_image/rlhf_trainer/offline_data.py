"""Datasets of the offline algorithms: prompt/response records (sft) and preference pairs (dpo,
ipo, cdpo, rm), tokenized, and packed into batches in the layout the model workers read.

Sources are read and mixed as in data.py; the prompt is rendered with the chat template (when
applyChatTemplate) and left-truncated to data.maxPromptTokens, each response gets the tokenizer's
eos and is cut so that prompt + response fit data.maxTokens (a warning counts the records cut).
Batches come from data.PromptLoader (one optimizer step's worth of examples each, reshuffled per
epoch, resumable).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_api.v1alpha1 import DatasetSpec, DataSpec

from .data import (IMAGES, conditioned, image_processor, image_prompt, load_records, processed_prompt, prompt_check,
                   render_prompt, score_check, text_check)
from .workers.vision import batch_inputs
from .rewards.process import step_token_ids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineExample:
    prompt_token_ids: list[int]
    responses: tuple[list[int], ...]  # sft: (response,); pairs: (chosen, rejected); each ends with eos
    desirable: bool | None = None  # kto records with a desirable flag (labelKey): whether the response is
    # prm: (response position, 1.0 correct / 0.0 wrong) of each step, at its separator's last token
    step_labels: tuple[tuple[int, float], ...] | None = None
    vision: dict | None = None  # a vision-language prompt's image inputs (data.PromptItem.vision)


@dataclass
class OfflineBatch:
    """Rows response-major: every example's first response, then (pairs) every second one.

    sequences [R, S]: the prompt left-padded, then the response right-padded; action_mask [R, T]
    marks the response tokens, the last T positions of sequences (as in experience.Experience).
    """

    sequences: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    reference_logps: Tensor | None = None  # [R] summed response log-probs under the reference (preference losses)
    desirable: Tensor | None = None  # [R] bool: chosen/desirable rows (preference losses)
    kl_logps: Tensor | None = None  # [2] kto: mean log pi and log pi_ref of the step's mismatched pairs
    step_tokens: Tensor | None = None  # [R] response tokens of the whole optimizer step (all micro-batches and ranks)
    teacher_logps: Tensor | None = None  # [R, T, k] kd: the teacher's k likeliest next tokens' log-probs, per response position
    teacher_ids: Tensor | None = None  # [R, T, k] kd: those tokens' ids
    step_labels: Tensor | None = None  # [R, T] prm: 1. / 0. where a step ends (correct / wrong), -1. elsewhere
    # [R, P, D] and [R, I, 3]: each row's prompt's image inputs, zero-padded (workers/vision.py)
    pixel_values: Tensor | None = None
    image_grid_thw: Tensor | None = None

    @property
    def vision(self) -> dict[str, Tensor] | None:
        return None if self.pixel_values is None else {"pixel_values": self.pixel_values,
                                                       "image_grid_thw": self.image_grid_thw}

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    def to(self, device) -> OfflineBatch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if getattr(self, f.name) is not None})


def pack(examples: list[OfflineExample], pad_token_id: int, reference_logps: Tensor | None = None,
         kl_logps: Tensor | None = None) -> OfflineBatch:
    """One batch of the examples; reference_logps [len(examples), responses per example] when known.

    Rows are desirable when they are the first of a pair, or flagged desirable."""
    rows = [(e.prompt_token_ids, e.responses[k]) for k in range(len(examples[0].responses)) for e in examples]
    width = max(len(prompt) for prompt, _ in rows)
    num_actions = max(len(response) for _, response in rows)

    def padded(ids: list[int], left: int, right: int, value) -> Tensor:
        return F.pad(torch.tensor(ids, dtype=torch.long), (left, right), value=value)

    sequences = torch.stack([
        torch.cat([padded(p, width - len(p), 0, pad_token_id), padded(r, 0, num_actions - len(r), pad_token_id)])
        for p, r in rows
    ])
    attention_mask = torch.stack([
        torch.cat([padded([1] * len(p), width - len(p), 0, 0), padded([1] * len(r), 0, num_actions - len(r), 0)])
        for p, r in rows
    ])
    action_mask = attention_mask[:, width:].bool()
    reference = reference_logps.T.reshape(-1) if reference_logps is not None else None
    if examples[0].desirable is None:
        desirable = torch.tensor([k == 0 for k in range(len(examples[0].responses)) for _ in examples])
    else:
        desirable = torch.tensor([bool(e.desirable) for e in examples])
    step_labels = None
    if examples[0].step_labels is not None:
        step_labels = torch.full(action_mask.shape, -1.0)
        for row, example in enumerate(examples):
            for position, label in example.step_labels:
                step_labels[row, position] = label
    vision = batch_inputs([e.vision for k in range(len(examples[0].responses)) for e in examples])
    return OfflineBatch(sequences, attention_mask, action_mask, reference, desirable, kl_logps,
                        step_labels=step_labels, **(vision or {}))


def with_step_tokens(batch: OfflineBatch, step_tokens: Tensor) -> OfflineBatch:
    """The batch, each row carrying its optimizer step's response token count (as Experience.step_tokens)."""
    return replace(batch, step_tokens=step_tokens.expand(batch.sequences.shape[0]).clone())


def mismatched(examples: list[OfflineExample]) -> list[OfflineExample]:
    """Each prompt with the next example's first response (kto's KL pairs (x, y'))."""
    return [OfflineExample(e.prompt_token_ids, (examples[(i + 1) % len(examples)].responses[0],), vision=e.vision)
            for i, e in enumerate(examples)]


class OfflineDataset:
    """Tokenized offline examples, indexable (a data.PromptLoader batches them)."""

    def __init__(self, items: list[OfflineExample]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> OfflineExample:
        return self.items[index]

    @classmethod
    def from_spec(cls, spec: DatasetSpec, data: DataSpec, tokenizer, *, response_keys: tuple[str, ...],
                  base_dir: Path, seed: int, name: str, flag_key: str | None = None,
                  conditioned_on_score: bool = False, step_labelled: bool = False) -> OfflineDataset:
        """`response_keys`: the record keys of the responses (outputKey; chosenKey and rejectedKey);
        `flag_key`: the key of a desirable flag (kto's labelKey); conditioned_on_score: each prompt carries
        its record's score (scoreKey) through data.scoreTemplate (csft); step_labelled: the response is a
        list of steps, labelKey a label for each, the steps joined by data.stepSeparator (prm)."""
        if step_labelled:
            return cls._step_labelled(spec, data, tokenizer, base_dir=base_dir, seed=seed, name=name)
        keys = {spec.input_key: prompt_check(spec.apply_chat_template), **dict.fromkeys(response_keys, text_check),
                **({flag_key: _flag_check} if flag_key else {}),
                **({spec.score_key: score_check} if conditioned_on_score else {})}
        split, with_images = chats_split(spec.input_key, response_keys), image_prompt(spec, base_dir, f"data.{name}")
        records = load_records(spec, tokenizer, keys, base_dir=base_dir, seed=seed, field=f"data.{name}",
                               prepare=lambda record: with_images(split(record)))
        if any(record.get(IMAGES) for record in records):
            if conditioned_on_score:
                raise ValueError(f"data.{name} has images: a score-conditioned prompt (data.scoreTemplate) is text only")
            processor = image_processor(tokenizer, f"data.{name}")
            rendered = [processed_prompt(processor, record, spec.input_key, data, f"data.{name}: record {i}")
                        for i, record in enumerate(records, 1)]
        else:
            rendered = None

        values = [record[spec.input_key] for record in records]
        if conditioned_on_score:
            values = [conditioned(value, record[spec.score_key], data.score_template)
                      for value, record in zip(values, records)]
        if rendered is None:
            prompts = [render_prompt(value, tokenizer, spec.apply_chat_template) for value in values]
            prompt_ids = _cut_prompts(tokenizer(prompts, add_special_tokens=False)["input_ids"], data, name)
        else:  # a vision-language model's, its images' tokens written out (never cut)
            prompt_ids = [ids for _, ids, _ in rendered]
        response_ids = {key: tokenizer([r[key] for r in records], add_special_tokens=False)["input_ids"]
                        for key in response_keys}
        eos = tokenizer.eos_token_id
        items, truncated = [], 0
        for i, prompt in enumerate(prompt_ids):
            room = data.max_tokens - len(prompt)
            responses = tuple((response_ids[key][i] + [eos])[:room] for key in response_keys)
            truncated += any(len(response_ids[key][i]) + 1 > room for key in response_keys)
            items.append(OfflineExample(prompt, responses, _flag(records[i][flag_key]) if flag_key else None,
                                        vision=rendered[i][2] if rendered else None))
        if truncated:
            log.warning("%d of %d %s records were longer than data.maxTokens=%d and lost their response's end",
                        truncated, len(items), name, data.max_tokens)
        return cls(items)

    @classmethod
    def _step_labelled(cls, spec: DatasetSpec, data: DataSpec, tokenizer, *, base_dir: Path, seed: int,
                       name: str) -> OfflineDataset:
        """prm's records: {inputKey: prompt, outputKey: [step, ...], labelKey: [label, ...]} (TRL's stepwise
        supervision); each step labelled at its separator's last token (rewards.process.step_token_ids, as
        a process reward source reads it). A solution cut by data.maxTokens keeps the labels of its whole steps."""
        keys = {spec.input_key: prompt_check(spec.apply_chat_template), spec.output_key: _steps_check,
                spec.label_key: _step_labels_check}
        records = load_records(spec, tokenizer, keys, base_dir=base_dir, seed=seed, field=f"data.{name}",
                               prepare=_one_label_a_step(spec.output_key, spec.label_key))
        prompts = [render_prompt(r[spec.input_key], tokenizer, spec.apply_chat_template) for r in records]
        items, cut = [], 0
        prompt_ids = _cut_prompts(tokenizer(prompts, add_special_tokens=False)["input_ids"], data, name)
        for prompt, record in zip(prompt_ids, records):
            solution = step_token_ids(tokenizer, record[spec.output_key], data.step_separator)
            room = data.max_tokens - len(prompt)
            labels = tuple((end, float(step_label(label))) for end, label in
                           zip(solution.positions, record[spec.label_key]) if end < room)
            cut += len(labels) < len(solution.positions)
            items.append(OfflineExample(prompt, (solution.ids[:room],), step_labels=labels))
        if cut:
            log.warning("%d of %d %s solutions were longer than data.maxTokens=%d and lost their last steps",
                        cut, len(items), name, data.max_tokens)
        return cls(items)


def _cut_prompts(prompt_ids: list[list[int]], data: DataSpec, name: str) -> list[list[int]]:
    """Each prompt cut to data.maxPromptTokens from the left (the end holds the question and the generation
    prompt), with a warning counting the prompts cut."""
    cut = sum(len(prompt) > data.max_prompt_tokens for prompt in prompt_ids)
    if cut:
        log.warning("%d of %d %s prompts were longer than data.maxPromptTokens=%d and lost their beginning",
                    cut, len(prompt_ids), name, data.max_prompt_tokens)
    return [prompt[-data.max_prompt_tokens:] for prompt in prompt_ids]


def chats_split(input_key: str, response_keys: tuple[str, ...]) -> Callable[[dict], dict]:
    """A record's responses given as whole chats (lists of {"role", "content"} messages; the preference
    data OpenRLHF reads without a prompt key, TRL's "implicit prompt" form) made prompt and text: each
    response is its chat's last message, the assistant's, and the prompt (input_key) the messages before
    it, which a pair's chats must share. That prompt replaces any the record has beside its chats (as
    UltraFeedback's prompt text); a chat of the response alone keeps the record's prompt. Records whose
    responses are text pass unchanged."""
    def is_chat(value) -> bool:
        return isinstance(value, list) and bool(value) and all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value)

    def split(record: dict) -> dict:
        chats = [record.get(key) for key in response_keys]
        if not any(map(is_chat, chats)):
            return record  # text (or what the key checks then refuse)
        for key, chat in zip(response_keys, chats):
            if not is_chat(chat):
                raise ValueError(f"{key!r} is not a chat while another response is: give "
                                 f"{' and '.join(map(repr, response_keys))} all as chats (lists of "
                                 '{"role", "content"} messages) or all as text')
            if chat[-1]["role"] != "assistant":
                raise ValueError(f"{key!r} is a chat whose last message is the {chat[-1]['role']}'s: the response "
                                 "must be the last message, the assistant's")
        prompt = chats[0][:-1]
        if any(chat[:-1] != prompt for chat in chats[1:]):
            raise ValueError(f"the chats of {' and '.join(map(repr, response_keys))} differ before their last "
                             "message: the messages before the response are the prompt, which a pair shares")
        split = {**record, **{key: chat[-1]["content"] for key, chat in zip(response_keys, chats)}}
        return {**split, input_key: prompt} if prompt else split
    return split


def _flag(value) -> bool | None:
    """A desirable flag: a boolean, 0/1, or "true"/"false"; None for anything else."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, (bool, int)) and value in (0, 1):
        return bool(value)
    return None


def _flag_check(value) -> str | None:
    return None if _flag(value) is not None else f"is the desirable flag: it must be true or false, not {value!r}"


def step_label(value) -> bool | None:
    """A step's label: a desirable flag's forms, or Math-Shepherd's "+" / "-"."""
    return value == "+" if value in ("+", "-") else _flag(value)


def _steps_check(value) -> str | None:
    if isinstance(value, list) and value and all(isinstance(step, str) for step in value):
        return None
    return f"is the solution's steps: it must be a non-empty list of strings, not {type(value).__name__}"


def _step_labels_check(value) -> str | None:
    if isinstance(value, list) and all(step_label(label) is not None for label in value):
        return None
    return f"is the steps' labels: it must be a list of true/false, 1/0 or +/- (one a step), not {value!r}"


def _one_label_a_step(steps_key: str, labels_key: str) -> Callable[[dict], dict]:
    def check(record: dict) -> dict:
        steps, labels = record.get(steps_key), record.get(labels_key)
        if isinstance(steps, list) and isinstance(labels, list) and len(steps) != len(labels):
            raise ValueError(f"{len(steps)} steps ({steps_key!r}) but {len(labels)} labels ({labels_key!r}): give "
                             "each step one label")
        return record
    return check
