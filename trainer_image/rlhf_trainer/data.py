"""Prompt datasets for online RL: read, mix, render with the chat template, tokenize, batch.

A source is a .jsonl/.json/.parquet file, a directory written by `datasets.save_to_disk`, or
anything `datasets.load_dataset` reads (a Hugging Face id, a local folder of data files); which
paths are local is `local_dataset`'s rule. Files must be UTF-8; a record that cannot be read, lacks
a key or has a value of the wrong type is refused naming the source, the record and the field.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Callable, Iterator

import numpy as np
from pydantic.alias_generators import to_camel

from rlhf_api.paths import is_hub_id, local_path
from rlhf_api.v1alpha1 import DatasetSource, DatasetSpec, DataSpec

from . import images

log = logging.getLogger(__name__)

Record = dict[str, Any]


@dataclass(frozen=True)
class PromptItem:
    prompt: str  # the text given to the generator (chat template applied)
    prompt_token_ids: list[int]  # its tokens, left-truncated to data.maxPromptTokens
    label: Any = None  # record[labelKey], handed to reward functions; None without labelKey
    # Vision-language prompts (images.py): each image's resolved reference, what rewards, environments and the
    # rollout engines get; and the processor's inputs of the images for the trainer's passes (pixel_values
    # [patches, D], image_grid_thw [images, 3]); prompt_token_ids then hold each image's tokens, expanded.
    images: tuple[str, ...] = ()
    vision: dict | None = None


# ------------------------------------------------------------------------------------- reading


def _text(path: Path) -> str:
    """The file as text; bytes that are not UTF-8 are refused naming their line (a leading BOM is fine)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - raw.rfind(b"\n", 0, error.start)
        raise ValueError(f"{path} line {line} column {column}: byte {raw[error.start]:#04x} is not UTF-8: "
                         "save the file as UTF-8") from None


def _json(text: str, path: Path, line: int = 1) -> Any:
    """text parsed as JSON; `line`: where text starts in the file."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} line {line + error.lineno - 1} column {error.colno}: not valid JSON "
                         f"({error.msg})") from None


def _record(value: Any, path: Path, where: str) -> Record:
    if not isinstance(value, dict):
        raise ValueError(f"{path} {where}: a record must be a JSON object, not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _read_jsonl(path: Path) -> list[Record]:
    lines = enumerate(_text(path).split("\n"), 1)
    return [_record(_json(line, path, number), path, f"line {number}") for number, line in lines if line.strip()]


def _read_json(path: Path) -> list[Record]:
    text = _text(path)
    records = _json(text, path) if text.strip() else []
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records (for one record per line, name the file .jsonl)")
    return [_record(record, path, f"record {number}") for number, record in enumerate(records, 1)]


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except pa.ArrowException as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None


FILE_READERS: dict[str, Callable[[Path], list[Record]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
}


def local_dataset(path: str, base_dir: Path) -> Path | None:
    """Where a dataset path is on disk, or None for a Hugging Face hub id (the rule DatasetSource.path
    documents): org/name without a data file suffix is a hub id unless base_dir/org/name exists;
    everything else (/..., ./..., ../..., a .jsonl/.json/.parquet name, a bare name, a longer path) is local."""
    local = local_path(path, base_dir)
    if is_hub_id(path) and PurePath(path).suffix not in FILE_READERS and not local.exists():
        return None
    return local


def missing_dataset(path: str, base_dir: Path) -> str | None:
    """What is wrong with a local dataset path that does not exist (None when it exists or is a hub id)."""
    local = local_dataset(path, base_dir)
    if local is None or local.exists():
        return None
    relative = "" if PurePath(path).is_absolute() else f", resolved against {Path(base_dir).resolve()} (the job file's directory)"
    return (f"{local} does not exist: {path!r} is a local path{relative}; only org/name without a "
            f"{'/'.join(FILE_READERS)} suffix is looked up on the Hugging Face hub: fix the path or create the file")


def read_records(source: DatasetSource, base_dir: Path) -> list[Record]:
    """All records of one source, in stored order."""
    path = local_dataset(source.path, base_dir)
    if problem := missing_dataset(source.path, base_dir):
        raise FileNotFoundError(problem)
    saved = path is not None and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())
    if path is not None and (path.is_file() or saved) and (source.config or source.revision):
        raise ValueError(f"{source.path}: config and revision select a Hugging Face dataset's subset and version; "
                         "a local file or a saved dataset has neither: remove them")
    if path is not None and path.is_file():
        if path.suffix not in FILE_READERS:
            raise ValueError(f"{path}: unsupported file type; use one of {', '.join(FILE_READERS)} or a datasets directory")
        return FILE_READERS[path.suffix](path)

    import datasets

    if saved:  # written by datasets.save_to_disk
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise ValueError(f"{path} has no split {source.split!r}; it has {', '.join(loaded)}")
            loaded = loaded[source.split]
        return loaded.to_list()
    location = source.path if path is None else str(path)  # a hub id, or a local folder of data files
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


def conditioned(prompt: Any, score: float, template: str) -> Any:
    """The prompt asking for a response of that score (csft, data.scoreTemplate): the template filled in
    with it; for chat messages, in the last user message's content."""
    shown = f"{score:g}"
    if isinstance(prompt, str):
        return template.format_map({"prompt": prompt, "score": shown})
    last = max(i for i, message in enumerate(prompt) if message["role"] == "user")
    filled = template.format_map({"prompt": prompt[last]["content"], "score": shown})
    return [*prompt[:last], {**prompt[last], "content": filled}, *prompt[last + 1:]]


def score_check(value: Any) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None
    return f"is a response's score: it must be a number, not {_shown(value)}"


# ---------------------------------------------------------------------------- records and checks

Check = Callable[[Any], str | None]  # a record's value -> what is wrong with it, or None


def prompt_check(apply_chat_template: bool) -> Check:
    """A prompt is text, or (with the chat template) a list of {"role", "content"} messages."""
    def check(value: Any) -> str | None:
        if isinstance(value, str):
            return None
        if not apply_chat_template:
            return f"must be a string, not {_shown(value)}: to render chat messages set applyChatTemplate: true"
        if isinstance(value, list) and value and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value):
            return None
        return f'must be a string or a list of {{"role", "content"}} messages, not {_shown(value)}'
    return check


def text_check(value: Any) -> str | None:
    return None if isinstance(value, str) else f"must be a string, not {_shown(value)}"


def _key_field(spec: DatasetSpec, key: str) -> str:
    """The field of spec naming record key `key` (inputKey, labelKey, ...), for messages."""
    return next(to_camel(field) for field in type(spec).model_fields
                if field.endswith("_key") and getattr(spec, field) == key)


def _problem(record: Record, keys: dict[str, Check | None], spec: DatasetSpec, where: str) -> str | None:
    for key, check in keys.items():
        field = f"{where}.{_key_field(spec, key)}"
        if key not in record:
            return (f"no key {key!r} ({field}); it has {', '.join(map(repr, record)) or 'no keys'}: "
                    f"set {field} to the dataset's field name")
        problem = check(record[key]) if check else None
        if problem:
            return f"{key!r} ({field}) {problem}"
    return None


def load_records(spec: DatasetSpec, tokenizer, keys: dict[str, Check | None], *, base_dir: Path, seed: int,
                 field: str, prepare: Callable[[Record], Record] | None = None) -> list[dict]:
    """spec's sources read (paths relative to base_dir), mixed with seed and cut to maxSamples.

    Every record (after `prepare`, which may raise ValueError) must have each key of `keys` and pass its
    check; errors name the source, the record (its number in its file, from 1; for .jsonl the n-th
    non-blank line) and the field. `field` is where spec holds the dataset, e.g. data.prompts."""
    sources = []
    for i, source in enumerate(spec.sources):
        where = f"{field}.sources[{i}] ({source.path})"
        try:
            records = read_records(source, base_dir)
        except Exception as error:  # noqa: BLE001 - whatever the reader or datasets raised: say which source
            raise ValueError(f"{where}: {error}") from error
        if not records:
            raise ValueError(f"{where} has no records: add some, or remove the source")
        for number, record in enumerate(records, 1):
            try:
                records[number - 1] = record = prepare(record) if prepare else record
            except ValueError as error:
                raise ValueError(f"{where} record {number}: {error}") from None
            if problem := _problem(record, keys, spec, field):
                raise ValueError(f"{where} record {number}: {problem}")
        sources.append(records)
    records = mix(sources, [s.probability for s in spec.sources], seed)[: spec.max_samples]
    if spec.apply_chat_template and tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer {tokenizer.name_or_path!r} has no chat template: set "
                         f"{field}.applyChatTemplate: false or use a tokenizer with one")
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
    def from_spec(cls, spec: DatasetSpec, data: DataSpec, tokenizer, *, base_dir: Path, seed: int,
                  field: str = "data.prompts") -> PromptDataset:
        """Read spec's sources (paths relative to base_dir), mix them with seed, render and tokenize;
        `field`: where the job holds spec, for error messages."""
        keys = {spec.input_key: prompt_check(spec.apply_chat_template), **({spec.label_key: None} if spec.label_key else {})}
        records = load_records(spec, tokenizer, keys, base_dir=base_dir, seed=seed, field=field,
                               prepare=image_prompt(spec, base_dir, field))
        if any(record.get(IMAGES) for record in records):
            return cls._with_images(records, spec, data, tokenizer, field)
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

    @classmethod
    def _with_images(cls, records: list[Record], spec: DatasetSpec, data: DataSpec, tokenizer, field: str) -> PromptDataset:
        """Prompts of a vision-language model: rendered by the model's processor (processed_prompt), which writes
        each image's placeholder tokens (as many as the image's size gives) and its pixel inputs."""
        processor = image_processor(tokenizer, field)
        items = []
        for number, record in enumerate(records, 1):
            text, ids, vision = processed_prompt(processor, record, spec.input_key, data, f"{field}: prompt {number}")
            items.append(PromptItem(text, ids, record[spec.label_key] if spec.label_key else None,
                                    tuple(record.get(IMAGES) or ()), vision))
        return cls(items)


IMAGES = "__images__"  # a record's resolved image references, in the order its prompt shows them (image_prompt)
PICTURES = "__pictures__"  # and the images they name, read (PIL, RGB)
VISION_INPUTS = ("pixel_values", "image_grid_thw")  # the processor's outputs a vision-language model's passes read


def image_processor(tokenizer, field: str):
    """The model's processor (AutoProcessor beside its tokenizer), refused without an image processor."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tokenizer.name_or_path)
    if getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{field} has images but the model {tokenizer.name_or_path!r} has no image processor: "
                         "use a vision-language model (one whose processor_config.json names an image processor)")
    return processor


def processed_prompt(processor, record: Record, input_key: str, data: DataSpec, where: str) -> tuple[str, list[int], dict | None]:
    """A record's prompt rendered by the processor (image_prompt's record): its text, its tokens with each image's
    tokens written out, and its images' inputs (None without images). A prompt with images is never cut (its
    image tokens would be): one longer than data.maxPromptTokens is refused."""
    refs = record.get(IMAGES) or ()
    messages = record[input_key] if refs else images.with_images(record[input_key], [])
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=record.get(PICTURES) or None, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    if len(ids) > data.max_prompt_tokens:
        raise ValueError(f"{where} (of the mixture) with its images is {len(ids)} tokens, more than "
                         f"data.maxPromptTokens={data.max_prompt_tokens}, and cutting it would cut its image "
                         "tokens: raise maxPromptTokens, or shrink the images (the processor's max_pixels)")
    return text, ids, {key: inputs[key] for key in VISION_INPUTS if key in inputs} if refs else None


def image_prompt(spec: DatasetSpec, base_dir: Path, field: str) -> Callable[[Record], Record]:
    """A record's prompt with its images (images.py: message parts, and imageKey's before the first user
    message's text), each reference resolved; the references under IMAGES, the images read under PICTURES. A
    record with an image that cannot be found or read is refused (load_records names it), never skipped."""
    def prepare(record: Record) -> Record:
        prompt = record.get(spec.input_key)
        if not isinstance(prompt, str) and not images.is_chat(prompt):
            return record  # prompt_check says what is wrong with it
        listed = record.get(spec.image_key) if spec.image_key else None  # a record without images lacks the key
        if listed is not None and (problem := images.images_check(listed)):
            raise ValueError(f"{spec.image_key!r} ({field}.imageKey) {problem}")
        listed = [] if listed is None else listed if isinstance(listed, list) else [listed]
        if not listed and not images.message_refs(prompt):
            return record
        if not spec.apply_chat_template:
            raise ValueError(f"has images, which only the chat template places: set {field}.applyChatTemplate: true")
        messages = images.with_images(prompt, listed)
        refs = [images.resolve(ref, base_dir, spec.fetch_image_urls) for ref in images.message_refs(messages)]
        resolved = iter(refs)
        for message in messages:
            if isinstance(message["content"], list):
                message["content"] = [{**part, "image": next(resolved)} if part.get("type") == images.IMAGE_PART
                                      else part for part in message["content"]]
        return {**record, spec.input_key: messages, IMAGES: refs, PICTURES: [images.load(ref) for ref in refs]}
    return prepare


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
