"""Datasets that are broken in the ways real ones are: missing files, empty files, bytes that are
not UTF-8, lines that are not JSON, records without a key or with a value of the wrong type, and
over-long records. Each error names the spec field, the file, the record and the key; over-long
records are truncated as DataSpec documents. Real files, the real tokenizer of the tiny model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlhf_api.v1alpha1 import DataSpec, DatasetSpec
from rlhf_trainer.data import PromptDataset, local_dataset, missing_dataset
from rlhf_trainer.offline_data import OfflineDataset
from rlhf_trainer.tiny import build_tokenizer

GOOD = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "answer": "4"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def jsonl(records: list) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def prompts(tokenizer, folder: Path, *files: str, **data):
    """The prompt dataset of `files` (sources 0, 1, ...) as the online trainer loads it."""
    spec = DatasetSpec.model_validate({"sources": [{"path": f} for f in files], "inputKey": "question", "labelKey": "answer"})
    return PromptDataset.from_spec(spec, DataSpec(**data), tokenizer, base_dir=folder, seed=0)


def pairs(tokenizer, folder: Path, file: str, flag: bool = False, **data):
    """The preference dataset of `file` as dpo (or, with flag, kto) loads it."""
    spec = DatasetSpec.model_validate({"sources": [{"path": file}], "inputKey": "question",
                                       **({"labelKey": "desirable"} if flag else {})})
    return OfflineDataset.from_spec(spec, DataSpec(**data), tokenizer, response_keys=("chosen", "rejected"),
                                    base_dir=folder, seed=0, name="preferences", flag_key="desirable" if flag else None)


# --------------------------------------------------------------------------------- files


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.jsonl", jsonl(GOOD) + b'{"question": "caf\xe9?", "answer": "x"}\n',
     r"bad.jsonl line 3 column 18: byte 0xe9 is not UTF-8: save the file as UTF-8"),
    ("bad.json", json.dumps(GOOD, indent=1).encode().replace(b"1 + 1", b"1 \xff 1"),
     r"bad.json line 3 column 26: byte 0xff is not UTF-8"),
    ("bad.jsonl", jsonl(GOOD) + b"\n" + b'{"question": "unterminated\n',
     r"bad.jsonl line 4 column 14: not valid JSON \(Unterminated string"),
    ("bad.jsonl", jsonl(GOOD) + b'["a list", "not a record"]\n',
     r'bad.jsonl line 3: a record must be a JSON object, not list \["a list", "not a record"\]'),
    ("bad.json", b'[{"question": "q", "answer": "a"}, 7]', r"bad.json record 2: a record must be a JSON object, not int 7"),
    ("bad.json", b'{"question": "q"}', r"bad.json: expected a JSON list of records"),
    ("bad.parquet", b"PAR1 but not really", r"bad.parquet: not a readable Parquet file"),
])
def test_unreadable_files_name_the_field_the_file_and_the_place(tokenizer, tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=rf"data.prompts.sources\[0\] \({name}\): .*{message}"):
        prompts(tokenizer, tmp_path, name)


def test_a_leading_byte_order_mark_is_fine(tokenizer, tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + jsonl(GOOD))
    assert [item.label for item in prompts(tokenizer, tmp_path, "bom.jsonl")] == ["2", "4"]


@pytest.mark.parametrize("name", ["empty.jsonl", "blank.jsonl", "empty.json", "list.json", "empty.parquet"])
def test_empty_files_are_refused_naming_the_source(tokenizer, tmp_path, name):
    (tmp_path / "good.jsonl").write_bytes(jsonl(GOOD))
    content = {"empty.jsonl": b"", "blank.jsonl": b"\n  \n", "empty.json": b"", "list.json": b"[]"}
    if name == "empty.parquet":
        pq.write_table(pa.table({"question": pa.array([], pa.string())}), tmp_path / name)
    else:
        (tmp_path / name).write_bytes(content[name])
    with pytest.raises(ValueError, match=rf"data.prompts.sources\[1\] \({name}\) has no records: add some, or remove the source"):
        prompts(tokenizer, tmp_path, "good.jsonl", name)


def test_a_missing_local_file_is_named_with_the_directory_and_never_looked_up_on_the_hub(tokenizer, tmp_path):
    with pytest.raises(ValueError) as refused:
        prompts(tokenizer, tmp_path, "missing.jsonl")
    message = str(refused.value)
    assert message.startswith(f"data.prompts.sources[0] (missing.jsonl): {tmp_path / 'missing.jsonl'} does not exist")
    assert f"resolved against {tmp_path.resolve()} (the job file's directory)" in message
    assert "Hub" not in message  # the issue: "Couldn't reach 'missing.jsonl' on the Hub"


@pytest.mark.parametrize(("path", "hub"), [
    ("openai/gsm8k", True),  # org/name: the hub, unless such a folder is here
    ("HuggingFaceH4/ultrafeedback_binarized", True),
    ("teknium/OpenHermes-2.5", True),  # a dot in a name is no file suffix
    ("missing.jsonl", False),  # a data file suffix: always local
    ("data/prompts.parquet", False),
    ("org/prompts.json", False),
    ("./gsm8k", False), ("../data/gsm8k", False), ("/data/gsm8k", False),  # ./ ../ /: local
    ("gsm8k", False),  # a bare name is a local folder
    ("data/more/prompts", False),  # deeper than org/name
])
def test_which_dataset_paths_are_local(tmp_path, path, hub):
    assert (local_dataset(path, tmp_path) is None) == hub
    assert (missing_dataset(path, tmp_path) is None) == hub  # none of them exists here
    (tmp_path / "openai" / "gsm8k").mkdir(parents=True)
    assert local_dataset("openai/gsm8k", tmp_path) == tmp_path / "openai" / "gsm8k"  # a folder here wins


# ------------------------------------------------------------------------------------- records


@pytest.mark.parametrize(("record", "message"), [
    ({"question": "q"}, r"no key 'answer' \(data.prompts.labelKey\); it has 'question': set data.prompts.labelKey "
                        r"to the dataset's field name"),
    ({"prompt": "q", "answer": "a"}, r"no key 'question' \(data.prompts.inputKey\); it has 'prompt', 'answer'"),
    ({}, r"no key 'question' \(data.prompts.inputKey\); it has no keys"),
    ({"question": 7, "answer": "a"}, r"'question' \(data.prompts.inputKey\) must be a string or a list of "
                                     r'{"role", "content"} messages, not int 7'),
    ({"question": [{"text": "hi"}], "answer": "a"}, r"'question' \(data.prompts.inputKey\) must be a string or a list"),
    ({"question": None, "answer": "a"}, r"'question' \(data.prompts.inputKey\) .* not NoneType null"),
])
def test_a_bad_record_names_source_record_and_key(tokenizer, tmp_path, record, message):
    (tmp_path / "a.jsonl").write_bytes(jsonl(GOOD))
    (tmp_path / "b.jsonl").write_bytes(jsonl([*GOOD, record]))
    with pytest.raises(ValueError, match=r"data.prompts.sources\[1\] \(b.jsonl\) record 3: " + message):
        prompts(tokenizer, tmp_path, "a.jsonl", "b.jsonl")


@pytest.mark.parametrize(("record", "flag", "message"), [
    ({"question": "q", "chosen": "a"}, False, r"no key 'rejected' \(data.preferences.rejectedKey\)"),
    ({"question": "q", "chosen": ["a"], "rejected": "b"}, False,
     r"'chosen' \(data.preferences.chosenKey\) must be a string, not list \[\"a\"\]"),
    ({"question": "q", "chosen": "a", "rejected": "b", "desirable": "maybe"}, True,
     r"'desirable' \(data.preferences.labelKey\) is the desirable flag: it must be true or false, not 'maybe'"),
])
def test_a_bad_offline_record_names_its_key(tokenizer, tmp_path, record, flag, message):
    good = [{"question": "q", "chosen": "a", "rejected": "b", "desirable": True}]
    (tmp_path / "p.jsonl").write_bytes(jsonl([*good, record]))
    with pytest.raises(ValueError, match=r"data.preferences.sources\[0\] \(p.jsonl\) record 2: " + message):
        pairs(tokenizer, tmp_path, "p.jsonl", flag=flag)


def test_over_long_records_are_truncated_as_documented(tokenizer, tmp_path, caplog):
    """DataSpec: prompts keep their last maxPromptTokens tokens; offline responses their first
    maxTokens - prompt tokens; a warning counts the records cut."""
    caplog.set_level(logging.WARNING)
    long_text = "word " * 2000
    (tmp_path / "p.jsonl").write_bytes(jsonl([{"question": long_text + "Last?", "answer": "x"}, *GOOD]))
    dataset = prompts(tokenizer, tmp_path, "p.jsonl", max_prompt_tokens=32)
    assert len(dataset[0].prompt_token_ids) == 32 and dataset[0].prompt.endswith("Last?<|im_end|>\n<|im_start|>assistant\n")
    assert "1 of 3 prompts were longer than maxPromptTokens=32" in caplog.text

    (tmp_path / "pairs.jsonl").write_bytes(jsonl([{"question": long_text, "chosen": long_text, "rejected": "b"}]))
    example = pairs(tokenizer, tmp_path, "pairs.jsonl", max_prompt_tokens=32, max_tokens=48)[0]
    assert len(example.prompt_token_ids) == 32 and len(example.responses[0]) == 16
    assert example.responses[1][-1] == tokenizer.eos_token_id  # the short one keeps its end
    assert "1 of 1 preferences prompts were longer than data.maxPromptTokens=32" in caplog.text
    assert "1 of 1 preferences records were longer than data.maxTokens=48" in caplog.text


def test_desirable_flags_in_their_accepted_forms(tokenizer, tmp_path):
    flags = [True, "false", 1, "TRUE", 0]
    records = [{"question": f"q{i}", "chosen": "a", "rejected": "b", "desirable": flag} for i, flag in enumerate(flags)]
    (tmp_path / "kto.jsonl").write_bytes(jsonl(records))
    dataset = pairs(tokenizer, tmp_path, "kto.jsonl", flag=True)
    assert sorted((tokenizer.decode(e.prompt_token_ids), e.desirable) for e in dataset.items) == sorted(
        (tokenizer.apply_chat_template([{"role": "user", "content": f"q{i}"}], tokenize=False, add_generation_prompt=True),
         want) for i, want in enumerate([True, False, True, True, False]))
