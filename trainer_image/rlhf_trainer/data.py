"""Prompt datasets for online RL: read, mix, render with the chat template, tokenize, batch.

A source is a .jsonl/.json/.parquet file, a directory written by `datasets.save_to_disk`, or
anything `datasets.load_dataset` reads (a Hugging Face id, a local folder of data files).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from rlhf_api.v1alpha1 import DatasetSource, DatasetSpec, DataSpec

from .paths import resolve

log = logging.getLogger(__name__)

Record = dict[str, Any]


@dataclass(frozen=True)
class PromptItem:
    prompt: str  # the text given to the generator (chat template applied)
    prompt_token_ids: list[int]  # its tokens, left-truncated to data.maxPromptTokens
    label: Any = None  # record[labelKey], handed to reward functions; None without labelKey


# ------------------------------------------------------------------------------------- reading


def _read_jsonl(path: Path) -> list[Record]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def _read_json(path: Path) -> list[Record]:
    records = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records (for one record per line, name the file .jsonl)")
    return records


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


FILE_READERS: dict[str, Callable[[Path], list[Record]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def read_records(source: DatasetSource, base_dir: Path) -> list[Record]:
    """All records of one source, in stored order."""
    location = resolve(source.path, base_dir)
    path = Path(location)
    saved = (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()  # datasets.save_to_disk
    if (path.is_file() or saved) and (source.config or source.revision):
        raise ValueError(f"{source.path}: config and revision select a Hugging Face dataset's subset and version; "
                         "a local file or a saved dataset has neither: remove them")
    if path.is_file():
        if path.suffix not in FILE_READERS:
            raise ValueError(f"{path}: unsupported file type; use one of {', '.join(FILE_READERS)} or a datasets directory")
        return FILE_READERS[path.suffix](path)

    import datasets

    if saved:
        loaded = datasets.load_from_disk(location)
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise ValueError(f"{path} has no split {source.split!r}; it has {', '.join(loaded)}")
            loaded = loaded[source.split]
        return loaded.to_list()
    return datasets.load_dataset(location, source.config, split=source.split, revision=source.revision).to_list()


def mix(sources: list[list[Record]], probabilities: list[float], seed: int) -> list[Record]:
    """Interleave sources: each position draws a source with the (normalised) probabilities.

    The mixture is as long as all sources together; a source drawn more often than it has
    records starts over, so small sources are oversampled rather than exhausted.
    """
    if len(sources) == 1:
        return sources[0]
    weights = np.asarray(probabilities, dtype=np.float64)
    draws = np.random.default_rng(seed).choice(len(sources), size=sum(map(len, sources)), p=weights / weights.sum())
    taken = [0] * len(sources)
    mixed = []
    for i in draws:
        mixed.append(sources[i][taken[i] % len(sources[i])])
        taken[i] += 1
    return mixed


# ----------------------------------------------------------------------------------- rendering


def render_prompt(value: Any, tokenizer, apply_chat_template: bool) -> str:
    """A prompt value (text, or a list of {"role", "content"} messages) as the text the model continues."""
    if apply_chat_template:
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(value, str):
        raise ValueError("the prompt is a list of chat messages: set applyChatTemplate: true to render it")
    return value


def load_records(spec: DatasetSpec, tokenizer, keys: list[str], *, base_dir: Path, seed: int, name: str) -> list[dict]:
    """spec's sources read (paths relative to base_dir), mixed with seed and cut to maxSamples; every
    record must have `keys`. `name` is the dataset's field under spec.data, for the error messages."""
    sources = []
    for source in spec.sources:
        records = read_records(source, base_dir)
        if not records:
            raise ValueError(f"dataset {source.path!r} has no records")
        sources.append(records)
    records = mix(sources, [s.probability for s in spec.sources], seed)[: spec.max_samples]
    if spec.apply_chat_template and tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no chat template: set "
                         f"data.{name}.applyChatTemplate: false or use a tokenizer with one")
    for index, record in enumerate(records):
        missing = [key for key in keys if key not in record]
        if missing:
            raise ValueError(f"{name} record {index} has no key {missing[0]!r} (it has {', '.join(map(repr, record))}): "
                             f"set data.{name}'s keys to the dataset's field names")
    return records


class PromptDataset:
    """Prompts ready for generation; indexable, in mixture order."""

    def __init__(self, items: list[PromptItem]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]

    @classmethod
    def from_spec(cls, spec: DatasetSpec, data: DataSpec, tokenizer, *, base_dir: Path, seed: int) -> PromptDataset:
        """Read spec's sources (paths relative to base_dir), mix them with seed, render and tokenize."""
        keys = [spec.input_key] + ([spec.label_key] if spec.label_key else [])
        records = load_records(spec, tokenizer, keys, base_dir=base_dir, seed=seed, name="prompts")
        texts = [render_prompt(record[spec.input_key], tokenizer, spec.apply_chat_template) for record in records]
        # The chat template already wrote the special tokens the model expects.
        token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        items, truncated = [], 0
        for text, ids, record in zip(texts, token_ids, records):
            if len(ids) > data.max_prompt_tokens:
                # Keep the end: the question and the generation prompt are there.
                ids = ids[-data.max_prompt_tokens :]
                text = tokenizer.decode(ids)
                truncated += 1
            items.append(PromptItem(text, ids, record[spec.label_key] if spec.label_key else None))
        if truncated:
            log.warning("%d of %d prompts were longer than maxPromptTokens=%d and lost their beginning",
                        truncated, len(items), data.max_prompt_tokens)
        return cls(items)


# ------------------------------------------------------------------------------------- batching


class PromptLoader:
    """Batches of prompts: one epoch per `for` loop, reshuffled each epoch, resumable mid-epoch.

        loader = PromptLoader(dataset, rollout_batch_size, seed=seed, shuffle=spec.shuffle)
        loader.load_state_dict(checkpoint["prompts"])  # when resuming
        while loader.epoch < episodes:
            for batch in loader:  # the rest of the current epoch
                ...  # a state_dict() taken here resumes with the next batch

    Only full batches are yielded; the remainder of an epoch's order is skipped (it lands
    elsewhere in the next epoch's order).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, seed: int, shuffle: bool = True):
        if len(dataset) < batch_size:
            raise ValueError(
                f"the prompt dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}: "
                "lower training.rolloutBatchSize or add prompts"
            )
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataset) // self.batch_size

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[list[PromptItem]]:
        order = self._order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            self.position += 1  # counted before the caller sees the batch: a checkpoint after it skips it
            yield [self.dataset[int(i)] for i in order[start : start + self.batch_size]]
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["prompts"] != len(self.dataset):
            raise ValueError(
                f"the checkpoint's data position is for {state['prompts']} prompts but the dataset has "
                f"{len(self.dataset)}: the data changed since the checkpoint; restore it or start a new run"
            )
        self.epoch, self.position = state["epoch"], state["position"]
