"""spec.data: prompt, preference and SFT datasets, and how records are read."""

from __future__ import annotations

from pydantic import Field

from .. import algorithms
from ..algorithms import prose
from .base import APIModel, cel
from .reward import DEFAULT_STEP_SEPARATOR

PREFERENCES = algorithms.reading("preferences")



class DatasetSource(APIModel):
    """One dataset in a mixture."""

    path: str = Field(min_length=1, max_length=1024)
    """A Hugging Face dataset id (org/name), or a local .jsonl/.json/.parquet file (UTF-8), a directory saved by datasets or a folder of data files, relative to the job file's directory or absolute. A path that starts with /, ./ or ../, ends in .jsonl, .json or .parquet, or is not of the form org/name is local, and rlhf run refuses it before starting when it does not exist; org/name is a local folder if one exists there, else read from the hub."""
    split: str = Field("train", max_length=64)
    """Split to read (Hugging Face datasets)."""
    config: str | None = Field(None, max_length=128)
    """Configuration (subset) of a Hugging Face dataset, e.g. main for openai/gsm8k; the name datasets.load_dataset takes."""
    revision: str | None = Field(None, max_length=128)
    """Hub revision (branch, tag or commit) of a Hugging Face dataset: pin it for a reproducible run."""
    probability: float = Field(1.0, gt=0, le=1)
    """Sampling probability in the mixture (normalised over sources)."""


class DatasetSpec(APIModel):
    """A dataset (or mixture) and how to read its records."""

    sources: list[DatasetSource] = Field(min_length=1, max_length=16)
    """The datasets to mix."""
    input_key: str = Field("prompt", max_length=128)
    """Record key of the prompt (a string, or a list of chat messages)."""
    label_key: str | None = Field(None, max_length=128, description=(
        "Record key passed to reward functions as the label (e.g. the reference answer); for kto, the desirable flag; "
        f"for {prose(algorithms.STEP_LABELLED)}, each step's label, a list as long as outputKey's steps (true/false, "
        "1/0 or +/-: whether the step is correct)."))
    score_key: str | None = Field(None, max_length=128, description=(
        f"Record key of each response's quality score, a number ({prose(algorithms.CONDITIONED)}: the prompt is "
        "conditioned on it, see data.scoreTemplate)."))
    output_key: str = Field("response", max_length=128, description=(
        'Record key of the target completion (sft): text, or a whole chat (a list of {"role", "content"} messages) '
        "whose last message, the assistant's, is the completion and the messages before it the prompt (in place of "
        f"inputKey's); for {prose(algorithms.STEP_LABELLED)}, the solution's steps, a list of strings (TRL's stepwise "
        "supervision: prompt, completions, labels)."))
    chosen_key: str = Field("chosen", max_length=128)
    """Record key of the preferred completion (dpo, ipo, cdpo, rm): text, or a whole chat as for outputKey (OpenRLHF's preference datasets without a prompt key); a pair's chats share the messages before their last."""
    rejected_key: str = Field("rejected", max_length=128)
    """Record key of the dispreferred completion (dpo, ipo, cdpo, rm): text, or a whole chat as chosenKey's."""
    image_key: str | None = Field(None, max_length=128, description=(
        "Record key of the record's images, for vision-language models: an image reference or a list of them, "
        "placed in the prompt's first user message at its text's <image> markers when it has one per image, else "
        "before its text (the model's processor writes each image's placeholder tokens). A Hugging Face dataset's "
        "Image column works as it is. A reference is a path relative to the data file's directory (or absolute), an "
        "http(s) URL (with fetchImageUrls) or the image's bytes in base64 (a data: URI or bare). Images may also be "
        'written in the chat messages themselves, a content part {"type": "image", "image": REF} each. A record '
        "whose image cannot be read is refused with its number and the reason, never skipped. Only "
        f"{prose(algorithms.TAKES_IMAGES)} take images."))
    fetch_image_urls: bool = False
    """Read images given as http(s) URLs (the trainer's pods fetch them at the start and the rollout engines at each rollout); false refuses a record with one: store the images beside the data instead."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many records."""
    shuffle: bool = True
    """Shuffle records with training.seed."""


class DataSpec(APIModel):
    """Training data. Which dataset is needed follows from spec.algorithm."""

    model_config = cel(("!has(self.scoreTemplate) || self.scoreTemplate.contains('{prompt}')",
                        "data.scoreTemplate must contain {prompt}, where the record's prompt goes", ".scoreTemplate"))

    prompts: DatasetSpec | None = Field(None, description=f"Prompts for online RL ({', '.join(algorithms.ONLINE)}).")
    preferences: DatasetSpec | None = Field(None, description=(
        f"Pairs (chosen/rejected) for {', '.join(PREFERENCES)}; for kto also records with a desirable flag."))
    sft: DatasetSpec | None = Field(None, description=(
        f"Prompt/response records for {', '.join(algorithms.reading('sft'))}."))
    max_prompt_tokens: int = Field(1024, ge=8, le=1 << 20)
    """Prompts longer than this are truncated from the left (their end, with the question and the generation prompt, is kept); a warning counts them."""
    score_template: str = Field("{prompt}\n\nQuality: {score}", max_length=1024, description=(
        f"{prose(algorithms.CONDITIONED)}: the prompt the model is trained on, {{prompt}} the record's and {{score}} its "
        "scoreKey value (for chat messages, the last user message's content is filled in). At inference write the "
        "prompt the same way with the top score to ask for the best responses."))
    step_separator: str = Field(DEFAULT_STEP_SEPARATOR, min_length=1, max_length=64, description=(
        f"{prose(algorithms.STEP_LABELLED)}: what follows each step of a solution; the model learns each step's label "
        "at the separator's last token. A reward source reading the model must split at the same "
        "(reward.sources[].steps.separator)."))
    max_tokens: int = Field(2048, ge=16, le=1 << 20)
    """Maximum prompt + response length for offline algorithms (sft, dpo, ...): a longer response loses its end; a warning counts them."""
