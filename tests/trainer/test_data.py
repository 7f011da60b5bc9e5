"""Prompt datasets: every format, rendering, truncation, mixing, and a loader that resumes in place."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlhf_api.paths import local_path, resolve
from rlhf_api.v1alpha1 import DatasetSpec, DataSpec
from rlhf_trainer.data import PromptDataset, PromptLoader, mix
from rlhf_trainer.offline_data import OfflineDataset
from rlhf_trainer.tiny import build_tokenizer

RECORDS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "extra": i} for i in range(20)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def prompts_spec(*paths: str, probabilities=None, **fields) -> DatasetSpec:
    probabilities = probabilities or [1.0] * len(paths)
    sources = [{"path": p, "probability": q} for p, q in zip(paths, probabilities)]
    return DatasetSpec.model_validate({"sources": sources, "inputKey": "question", "labelKey": "answer", **fields})


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load(tokenizer, spec: DatasetSpec, base_dir: Path, seed: int = 0, **data) -> PromptDataset:
    return PromptDataset.from_spec(spec, DataSpec(**data), tokenizer, base_dir=base_dir, seed=seed)


# ------------------------------------------------------------------------------------- formats


def write_every_format(folder: Path) -> dict[str, str]:
    """The same records in each supported format; name -> path relative to folder."""
    write_jsonl(folder / "prompts.jsonl", RECORDS)
    (folder / "prompts.json").write_text(json.dumps(RECORDS))
    pq.write_table(pa.Table.from_pylist(RECORDS), folder / "prompts.parquet")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(folder / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(folder / "saved-dict"))
    (folder / "data-files").mkdir()
    write_jsonl(folder / "data-files" / "train.jsonl", RECORDS)  # read by datasets.load_dataset
    return {
        "jsonl": "prompts.jsonl", "json": "prompts.json", "parquet": "prompts.parquet",
        "save_to_disk": "saved", "save_to_disk dict": "saved-dict", "load_dataset folder": "data-files",
    }


def test_every_format_gives_the_same_prompts(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    formats = write_every_format(tmp_path)
    loaded = {name: load(tokenizer, prompts_spec(path), tmp_path) for name, path in formats.items()}
    expected = [(r["question"], r["answer"]) for r in RECORDS]
    for name, dataset in loaded.items():
        assert len(dataset) == len(RECORDS), name
        assert [(item.prompt.split("\n")[1].removesuffix("<|im_end|>"), item.label) for item in dataset] == expected, name
        assert [item.prompt_token_ids for item in dataset] == [item.prompt_token_ids for item in loaded["jsonl"]], name


def test_split_must_exist_in_a_saved_dataset_dict(tokenizer, tmp_path):
    write_every_format(tmp_path)
    spec = DatasetSpec.model_validate({"sources": [{"path": "saved-dict", "split": "test"}], "inputKey": "question"})
    with pytest.raises(ValueError, match="no split 'test'; it has train"):
        load(tokenizer, spec, tmp_path)


def test_unsupported_file_type_and_bad_json_are_explained(tokenizer, tmp_path):
    (tmp_path / "prompts.csv").write_text("question\nhi\n")
    with pytest.raises(ValueError, match=r"unsupported file type; use one of \.jsonl, \.json, \.parquet"):
        load(tokenizer, prompts_spec("prompts.csv"), tmp_path)
    (tmp_path / "prompts.json").write_text(json.dumps({"question": "hi"}))
    with pytest.raises(ValueError, match="expected a JSON list of records"):
        load(tokenizer, prompts_spec("prompts.json"), tmp_path)


def write_multi_config_dataset(folder: Path) -> None:
    """A dataset laid out as openai/gsm8k is on the hub: two configurations declared in its README's
    YAML header, each with its own data files."""
    folder.mkdir()
    for config, records in (("main", RECORDS[:12]), ("socratic", RECORDS[12:])):
        (folder / config).mkdir()
        pq.write_table(pa.Table.from_pylist(records), folder / config / "train-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {config}\n  data_files:\n  - split: train\n    path: {config}/train-*\n"
        for config in ("main", "socratic")) + "---\n")


def test_a_configuration_of_a_multi_config_dataset_is_read_as_the_gsm8k_example_names_it(tokenizer, tmp_path,
                                                                                          monkeypatch):
    """The GSM8K example could not load its dataset: openai/gsm8k needs a configuration name."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    write_multi_config_dataset(tmp_path / "gsm8k")
    spec = DatasetSpec.model_validate({"sources": [{"path": "gsm8k", "config": "main", "split": "train"}],
                                       "inputKey": "question", "labelKey": "answer"})
    assert [item.label for item in load(tokenizer, spec, tmp_path)] == [r["answer"] for r in RECORDS[:12]]
    socratic = spec.model_copy(update={"sources": [spec.sources[0].model_copy(update={"config": "socratic"})]})
    assert [item.label for item in load(tokenizer, socratic, tmp_path)] == [r["answer"] for r in RECORDS[12:]]


def test_config_and_revision_are_refused_for_local_files(tokenizer, tmp_path):
    write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    spec = DatasetSpec.model_validate({"sources": [{"path": "prompts.jsonl", "config": "main"}], "inputKey": "question"})
    with pytest.raises(ValueError, match="a local file or a saved dataset has neither: remove them"):
        load(tokenizer, spec, tmp_path)


# ----------------------------------------------------------------------------------- rendering


def test_prompts_are_rendered_with_the_chat_template_and_tokenized(tokenizer, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", RECORDS[:2])
    item = load(tokenizer, prompts_spec("p.jsonl"), tmp_path)[1]
    assert item.prompt == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    assert item.prompt_token_ids == tokenizer(item.prompt, add_special_tokens=False)["input_ids"]
    assert item.prompt_token_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert item.label == "2"


def test_chat_message_lists_are_rendered_as_conversations(tokenizer, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    write_jsonl(tmp_path / "p.jsonl", [{"question": messages, "answer": "x"}])
    item = load(tokenizer, prompts_spec("p.jsonl"), tmp_path)[0]
    assert item.prompt == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert item.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_without_chat_template_the_text_is_used_as_is(tokenizer, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", RECORDS[:3])
    dataset = load(tokenizer, prompts_spec("p.jsonl", applyChatTemplate=False), tmp_path)
    assert [item.prompt for item in dataset] == [r["question"] for r in RECORDS[:3]]
    write_jsonl(tmp_path / "chat.jsonl", [{"question": [{"role": "user", "content": "Hi"}], "answer": "x"}])
    with pytest.raises(ValueError, match="set applyChatTemplate: true"):
        load(tokenizer, prompts_spec("chat.jsonl", applyChatTemplate=False), tmp_path)


def test_long_prompts_lose_their_beginning(tokenizer, tmp_path):
    long_question = "word " * 40 + "What is the answer?"
    write_jsonl(tmp_path / "p.jsonl", [{"question": long_question, "answer": "x"}, {"question": "Hi", "answer": "y"}])
    full = load(tokenizer, prompts_spec("p.jsonl"), tmp_path)
    cut = load(tokenizer, prompts_spec("p.jsonl"), tmp_path, max_prompt_tokens=16)
    assert len(full[0].prompt_token_ids) > 16
    assert cut[0].prompt_token_ids == full[0].prompt_token_ids[-16:]
    assert cut[0].prompt == tokenizer.decode(cut[0].prompt_token_ids)
    assert cut[0].prompt.endswith(" answer?<|im_end|>\n<|im_start|>assistant\n")
    assert len(full[1].prompt_token_ids) <= 16 and cut[1] == full[1]


def test_labels_are_none_without_a_label_key(tokenizer, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", RECORDS[:3])
    spec = DatasetSpec.model_validate({"sources": [{"path": "p.jsonl"}], "inputKey": "question"})
    assert [item.label for item in load(tokenizer, spec, tmp_path)] == [None] * 3


def test_missing_keys_name_the_key_and_the_record(tokenizer, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [*RECORDS[:2], {"question": "no answer here"}])
    with pytest.raises(ValueError, match=r"data.prompts.sources\[0\] \(p.jsonl\) record 3: no key 'answer' "
                                         r"\(data.prompts.labelKey\); it has 'question': set data.prompts.labelKey"):
        load(tokenizer, prompts_spec("p.jsonl"), tmp_path)
    spec = DatasetSpec.model_validate({"sources": [{"path": "p.jsonl"}], "inputKey": "prompt"})
    with pytest.raises(ValueError, match=r"record 1: no key 'prompt' \(data.prompts.inputKey\)"):
        load(tokenizer, spec, tmp_path)


def test_max_samples_limits_the_dataset(tokenizer, tmp_path):
    write_jsonl(tmp_path / "p.jsonl", RECORDS)
    dataset = load(tokenizer, prompts_spec("p.jsonl", maxSamples=5), tmp_path)
    assert [item.label for item in dataset] == [r["answer"] for r in RECORDS[:5]]


# -------------------------------------------------------------------------------------- mixing


def test_mixing_follows_the_probabilities_and_oversamples_small_sources():
    big = [{"source": "big", "i": i} for i in range(900)]
    small = [{"source": "small", "i": i} for i in range(100)]
    mixed = mix([big, small], [0.25, 0.75], seed=3)  # probabilities need not sum to 1 (normalised): here they do
    assert len(mixed) == 1000
    share = Counter(r["source"] for r in mixed)["small"] / len(mixed)
    assert 0.70 < share < 0.80
    smalls = [r["i"] for r in mixed if r["source"] == "small"]
    assert smalls == [i % 100 for i in range(len(smalls))]  # in order, starting over when used up
    assert mix([big, small], [0.25, 0.75], seed=3) == mixed
    assert mix([big, small], [0.25, 0.75], seed=4) != mixed
    assert mix([big], [0.5], seed=0) == big


def test_a_mixture_from_two_files(tokenizer, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", RECORDS[:10])
    write_jsonl(tmp_path / "b.jsonl", [{"question": "Other?", "answer": "other"}] * 10)
    dataset = load(tokenizer, prompts_spec("a.jsonl", "b.jsonl", probabilities=[0.5, 0.5]), tmp_path, seed=1)
    labels = Counter(item.label == "other" for item in dataset)
    assert len(dataset) == 20 and labels[True] > 0 and labels[False] > 0


def test_an_empty_source_is_refused(tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"data.prompts.sources\[0\] \(empty.jsonl\) has no records"):
        load(tokenizer, prompts_spec("empty.jsonl"), tmp_path)


# ------------------------------------------------------------------------------------- loading


@pytest.fixture
def dataset(tokenizer, tmp_path) -> PromptDataset:
    write_jsonl(tmp_path / "p.jsonl", RECORDS)
    return load(tokenizer, prompts_spec("p.jsonl"), tmp_path)


def labels(batches) -> list[list[str]]:
    return [[item.label for item in batch] for batch in batches]


def run_epochs(loader: PromptLoader, episodes: int) -> list[list[str]]:
    seen = []
    while loader.epoch < episodes:
        seen += labels(loader)
    return seen


def test_each_epoch_is_a_fresh_permutation_in_full_batches(dataset):
    loader = PromptLoader(dataset, 6, seed=7)
    assert len(loader) == 3
    epochs = [labels(loader) for _ in range(3)]
    for batches in epochs:
        assert len(batches) == 3 and all(len(b) == 6 for b in batches)
        flat = [label for batch in batches for label in batch]
        assert len(set(flat)) == 18  # no repeats within an epoch; 2 of 20 left over
    assert epochs[0] != epochs[1] != epochs[2]
    assert loader.epoch == 3
    assert run_epochs(PromptLoader(dataset, 6, seed=7), 3) == [b for e in epochs for b in e]
    assert run_epochs(PromptLoader(dataset, 6, seed=8), 1) != epochs[0]


def test_without_shuffle_batches_follow_the_dataset(dataset):
    loader = PromptLoader(dataset, 5, seed=7, shuffle=False)
    assert labels(loader) == [[r["answer"] for r in RECORDS[i : i + 5]] for i in range(0, 20, 5)]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6, 8])  # mid-epoch, at an epoch's end, in the second epoch...
def test_a_resumed_loader_continues_with_the_same_batches(dataset, stop_after):
    uninterrupted = run_epochs(PromptLoader(dataset, 5, seed=11), 3)

    first = PromptLoader(dataset, 5, seed=11)
    seen, state = [], None
    while state is None:
        for batch in first:
            seen.append([item.label for item in batch])
            if len(seen) == stop_after:  # checkpoint after this step, then the run dies
                state = json.loads(json.dumps(first.state_dict()))
                break

    second = PromptLoader(dataset, 5, seed=11)
    second.load_state_dict(state)
    assert seen + run_epochs(second, 3) == uninterrupted


def test_a_position_from_different_data_is_refused(dataset):
    state = PromptLoader(dataset, 5, seed=0).state_dict()
    smaller = PromptLoader(PromptDataset(dataset.items[:10]), 5, seed=0)
    with pytest.raises(ValueError, match="position is for 20 prompts but the dataset has 10"):
        smaller.load_state_dict(state)


def test_a_dataset_smaller_than_a_batch_is_refused(dataset):
    with pytest.raises(ValueError, match="20 prompts, fewer than one batch of 32: lower training.rolloutBatchSize"):
        PromptLoader(dataset, 32, seed=0)


# --------------------------------------------------------------------------------------- paths


def test_paths_are_relative_to_the_job_file(tmp_path):
    (tmp_path / "tiny" / "model").mkdir(parents=True)
    assert resolve("tiny/model", tmp_path) == str(tmp_path / "tiny" / "model")  # local folder wins
    assert resolve("Qwen/Qwen2.5-0.5B", tmp_path) == "Qwen/Qwen2.5-0.5B"  # a hub id
    assert resolve("openai/gsm8k", tmp_path) == "openai/gsm8k"
    assert resolve("/data/prompts.jsonl", tmp_path) == "/data/prompts.jsonl"
    assert resolve("data/more/prompts.jsonl", tmp_path) == str(tmp_path / "data/more/prompts.jsonl")
    assert resolve("./prompts.jsonl", tmp_path) == str(tmp_path / "prompts.jsonl")
    assert local_path("tiny/reward.py", tmp_path) == tmp_path / "tiny" / "reward.py"  # never a hub id
    assert local_path("/etc/rlhf/rewards/x.py", tmp_path) == Path("/etc/rlhf/rewards/x.py")


# ------------------------------------------------------------------------- responses as whole chats


def offline(tokenizer, folder: Path, file: str, response_keys=("chosen", "rejected"), **fields) -> OfflineDataset:
    """The offline dataset of `file` as dpo (chosen, rejected) or sft ((outputKey,)) loads it."""
    spec = DatasetSpec.model_validate({"sources": [{"path": file}], "shuffle": False, **fields})
    return OfflineDataset.from_spec(spec, DataSpec(), tokenizer, response_keys=response_keys, base_dir=folder, seed=0,
                                    name="preferences")


def chat(*turns: str) -> list[dict]:
    """Messages alternating user, assistant, ... from the first."""
    return [{"role": ("user", "assistant")[i % 2], "content": text} for i, text in enumerate(turns)]


SYSTEM = [{"role": "system", "content": "Be brief."}]


@pytest.mark.parametrize("form", ["chats only (OpenRLHF's preference mixtures)",
                                  "chats beside the prompt's text (UltraFeedback)",
                                  "the prompt, then chats of the response alone (TRL's explicit prompt)"])
def test_preference_pairs_given_as_whole_chats_are_the_pairs_of_their_last_messages(tokenizer, tmp_path, form):
    prompt = [*SYSTEM, *chat("Hi", "Hello!", "What is 2 + 2?")]
    write_jsonl(tmp_path / "text.jsonl", [{"prompt": prompt, "chosen": "4", "rejected": "5"}])
    record = {"chosen": [*prompt, *chat("", "4")[1:]], "rejected": [*prompt, *chat("", "5")[1:]]}
    if form.startswith("chats beside"):
        record["prompt"] = "What is 2 + 2?"  # the chats' prompt wins: this text lacks the turns before it
    elif form.startswith("the prompt, then"):
        record = {"prompt": prompt, "chosen": chat("", "4")[1:], "rejected": chat("", "5")[1:]}
    write_jsonl(tmp_path / "chats.jsonl", [record])
    [expected], [example] = offline(tokenizer, tmp_path, "text.jsonl"), offline(tokenizer, tmp_path, "chats.jsonl")
    assert example == expected
    assert tokenizer.decode(example.prompt_token_ids).endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert [tokenizer.decode(r) for r in example.responses] == ["4<|im_end|>", "5<|im_end|>"]


def test_sft_records_given_as_one_chat_train_its_last_message_after_the_others(tokenizer, tmp_path):
    write_jsonl(tmp_path / "text.jsonl", [{"prompt": chat("Hi", "Hello!", "Bye"), "response": "See you"}])
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat("Hi", "Hello!", "Bye", "See you")}])
    assert (offline(tokenizer, tmp_path, "chats.jsonl", ("messages",), outputKey="messages").items
            == offline(tokenizer, tmp_path, "text.jsonl", ("response",)).items)


@pytest.mark.parametrize(("record", "message"), [
    ({"chosen": chat("Hi", "A"), "rejected": chat("Hello", "B")},
     r"the chats of 'chosen' and 'rejected' differ before their last message: the messages before the response "
     r"are the prompt, which a pair shares"),
    ({"chosen": chat("Hi", "A"), "rejected": chat("Hi", "B", "C")},
     r"'rejected' is a chat whose last message is the user's: the response must be the last message"),
    ({"prompt": "Hi", "chosen": chat("Hi", "A"), "rejected": "B"},
     r"'rejected' is not a chat while another response is: give 'chosen' and 'rejected' all as chats"),
    ({"chosen": [], "rejected": chat("Hi", "B")}, r"'chosen' is not a chat while another response is"),
])
def test_chats_that_are_no_pair_are_refused_with_the_record_and_the_fix(tokenizer, tmp_path, record, message):
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": "A", "rejected": "B"}, record])
    with pytest.raises(ValueError, match=rf"data.preferences.sources\[0\] \(pairs.jsonl\) record 2: {message}"):
        offline(tokenizer, tmp_path, "pairs.jsonl")
