"""`rlhf run` refuses, before Ray starts (exit 2), a local dataset file that is not there and a
reward function that cannot be imported or cannot be called as the trainer calls it; each error
names the spec field, and a missing file the directory its path was resolved against."""

from __future__ import annotations

import sys

import pytest
import ray
import yaml

from rlhf_api.planning.placement import plan_placement
from rlhf_api.validation import InvalidJob, validate
from rlhf_cli.cli import main
from rlhf_trainer.checks import check, check_cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def isolated_import_path(monkeypatch):
    """Reward files put their folder on sys.path: keep that within each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def refused(job, tmp_path, capsys) -> str:
    """rlhf run on job: exit 2, nothing started; returns what it printed."""
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 2
    assert not ray.is_initialized()
    return capsys.readouterr().err


def reward(entrypoint: str, **function) -> dict:
    return {"reward.sources": [{"name": "judge", "type": "function", "function": {"entrypoint": entrypoint, **function}}]}


def test_a_missing_prompts_file_is_refused_naming_the_field_and_the_directory(toy_job, tmp_path, capsys):
    job = toy_job(**{"data.prompts.sources": [{"path": "tiny/prompts.jsonl"}, {"path": "missing.jsonl"}]})
    error = refused(job, tmp_path, capsys)
    assert (f"spec.data.prompts.sources[1].path: {tmp_path / 'missing.jsonl'} does not exist: 'missing.jsonl' is a "
            f"local path, resolved against {tmp_path.resolve()} (the job file's directory)") in error, error
    assert "sources[0]" not in error  # the file that is there is not complained about


def test_a_missing_offline_dataset_is_refused(toy_job, tmp_path, capsys):
    job = toy_job(**{"algorithm": "sft", "reward": None, "data.prompts": None,
                     "data.sft": {"sources": [{"path": "/nowhere/sft.parquet"}]}})
    error = refused(job, tmp_path, capsys)
    assert "spec.data.sft.sources[0].path: /nowhere/sft.parquet does not exist" in error, error
    assert "resolved against" not in error  # an absolute path is not resolved against anything


def test_a_missing_evaluation_set_is_refused(toy_job, tmp_path, capsys):
    job = toy_job(**{"evaluation": {"datasets": [{"name": "held-out", "sources": [{"path": "eval/held-out.jsonl"}]}]}})
    error = refused(job, tmp_path, capsys)
    assert f"spec.evaluation.datasets[0].sources[0].path: {tmp_path / 'eval/held-out.jsonl'} does not exist" in error, error


def test_a_hub_dataset_id_is_left_for_the_hub(toy_job, tmp_path):
    job = validate(yaml.safe_load(toy_job(**{"data.prompts.sources": [{"path": "openai/gsm8k"}]}).read_text()))
    check(job.spec, tmp_path)  # no refusal: org/name is looked up on the hub when the run reads it


REWARD_FILES = {
    # name -> (the file's text, what the error must say)
    "one parameter": ("def score(completions):\n    return [0.0] * len(completions)\n",
                      "judge.py:score takes (completions) but is called with three positional arguments "
                      "(prompts, completions, labels) (too many positional arguments): give it parameters"),
    "keyword-only labels": ("def score(prompts, completions, *, labels):\n    return []\n",
                            "takes (prompts, completions, *, labels)"),
    "async": ("async def score(prompts, completions, labels):\n    return []\n", "judge.py:score is async"),
    "syntax error": ("def score(prompts, completions, labels)\n    return []\n", "SyntaxError: expected ':'"),
    "failing import": ("import no_such_package_here\n", "ModuleNotFoundError: No module named 'no_such_package_here'"),
    "not a function": ("score = 3\n", "has no function 'score': fix function.entrypoint"),
}


@pytest.mark.parametrize("case", REWARD_FILES)
def test_a_reward_function_that_cannot_be_called_is_refused(case, toy_job, tmp_path, capsys):
    text, message = REWARD_FILES[case]
    (tmp_path / "judge.py").write_text(text)
    error = refused(toy_job(**reward("judge.py:score")), tmp_path, capsys)
    assert "spec.reward.sources[0].function.entrypoint: " in error and message in error, error


def test_a_missing_reward_file_or_configmap_file_is_refused(toy_job, tmp_path, capsys):
    error = refused(toy_job(**reward("rewards/judge.py:score")), tmp_path, capsys)
    assert (f"spec.reward.sources[0].function.entrypoint: FileNotFoundError: {tmp_path / 'rewards/judge.py'} does not "
            "exist (relative paths start at the job file's directory)") in error, error
    error = refused(toy_job(**reward("judge.py:score", configMap="judge-code")), tmp_path, capsys)
    assert ("/etc/rlhf/rewards/judge/judge.py does not exist (the ConfigMap 'judge-code' is mounted at "
            "/etc/rlhf/rewards/judge in the cluster") in error, error


def test_every_problem_is_reported_at_once(toy_job, tmp_path, capsys):
    (tmp_path / "judge.py").write_text("def score(prompts):\n    return []\n")
    job = toy_job(**{"data.prompts.sources": [{"path": "missing.jsonl"}], **reward("judge.py:score")})
    error = refused(job, tmp_path, capsys)
    assert "spec.data.prompts.sources[0].path" in error and "spec.reward.sources[0].function.entrypoint" in error


@pytest.mark.parametrize("signature", ["prompts, completions, labels", "prompts, completions, labels=None, **options",
                                       "*args", "p, c, l, scale=2.0"])
def test_functions_the_trainer_can_call_pass(signature, toy_job, tmp_path):
    (tmp_path / "judge.py").write_text(f"def score({signature}):\n    return []\n")
    job = validate(yaml.safe_load(toy_job(**reward("judge.py:score")).read_text()))
    check(job.spec, tmp_path)


def test_the_check_is_the_one_the_run_makes(toy_job, tmp_path):
    """check() raises what `rlhf run` prints, field by field."""
    (tmp_path / "judge.py").write_text("def score(completions):\n    return []\n")
    job = validate(yaml.safe_load(toy_job(**reward("judge.py:score")).read_text()))
    with pytest.raises(InvalidJob) as invalid:
        check(job.spec, tmp_path)
    assert [error.path for error in invalid.value.errors] == ["spec.reward.sources[0].function.entrypoint"]


def test_a_cluster_short_of_cpus_for_its_gpu_bundles_is_refused_naming_the_worker_cpus(toy_job):
    """Each GPU bundle asks for a GPU and a CPU to drive it: a cluster with the GPUs but fewer CPUs
    (worker pods with cpu below gpusPerNode, a head with none) could never place them; refused up front."""
    job = validate(yaml.safe_load(toy_job(**{"resources.nodes": 2, "resources.gpusPerNode": 2}).read_text()))
    placement = plan_placement(job.spec, use_gpu=True)
    assert placement.needs == {"GPU": placement.bundles, "CPU": placement.bundles}
    check_cluster(job.spec, placement, {"GPU": 4, "CPU": 4})
    with pytest.raises(InvalidJob) as refusal:
        check_cluster(job.spec, placement, {"GPU": 4, "CPU": 2})
    assert [error.path for error in refusal.value.errors] == ["spec.resources.worker.cpu"]
    assert (f"the job needs {placement.bundles} CPUs (one per rank and vLLM worker) but the Ray cluster has 2: give "
            "each worker pod at least one CPU per GPU") in str(refusal.value)


def test_flash_attention_without_flash_attn_is_refused_before_any_model_loads(toy_job, tmp_path, monkeypatch):
    """Each model group used to raise ImportError while loading, once the whole cluster was up."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not importable, as in the trainer image
    job = validate(yaml.safe_load(toy_job(**{"models.actor.attnImplementation": "flash_attention_2",
                                             "resources.image": "registry.example/trainer-flash-attn:1"}).read_text()))
    with pytest.raises(InvalidJob) as refusal:
        check(job.spec, tmp_path)
    assert [error.path for error in refusal.value.errors] == ["spec.models.actor.attnImplementation"]
    assert "flash_attention_2 needs the flash-attn package, which this environment lacks: set attnImplementation: " \
           "sdpa" in str(refusal.value)


def test_a_teacher_of_another_vocabulary_is_refused(toy_job, tiny_model, tmp_path, capsys):
    """distill's teacher scores the actor's token ids: one with another tokenizer would read other tokens."""
    import json
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model, teacher)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    job = toy_job(**{"algorithm": "distill", "models.teacher": {"path": str(teacher)}})
    error = refused(job, tmp_path, capsys)
    assert "spec.models.teacher" in error and f"({config['vocab_size'] + 7} tokens) is not the actor's" in error, error
    # The same teacher with the actor's vocabulary passes the check.
    (teacher / "config.json").write_text(json.dumps(config))
    check(validate(yaml.safe_load(job.read_text())).spec, job.parent)


def test_a_process_reward_model_is_read_at_the_separator_it_learnt(toy_job, tiny_reward_model, tmp_path, capsys):
    """prm records its data.stepSeparator in the exported config (step_separator): a source that reads that
    model whole, or splits at another separator, would score positions it never learnt, and is refused."""
    import json
    import shutil

    prm = tmp_path / "prm"
    shutil.copytree(tiny_reward_model, prm)
    config = json.loads((prm / "config.json").read_text())
    (prm / "config.json").write_text(json.dumps({**config, "step_separator": "\n\n"}))
    letter = yaml.safe_load(toy_job().read_text())["spec"]["reward"]["sources"][0]
    for steps, where, says in ((None, "spec.reward.sources[0]", "read it step by step"),
                               ({"separator": "\n"}, "spec.reward.sources[0].steps.separator",
                                "learnt steps ending in '\\n\\n', not '\\n'")):
        source = {"name": "prm", "type": "model", **({"steps": steps} if steps else {})}
        job = toy_job(**{"models.reward": {"path": str(prm)}, "reward.sources": [source, letter]})
        error = refused(job, tmp_path, capsys)
        assert where in error and says in error, error
    job = toy_job(**{"models.reward": {"path": str(prm)},
                     "reward.sources": [{"name": "prm", "type": "model", "steps": {"separator": "\n\n"}}, letter]})
    check(validate(yaml.safe_load(job.read_text())).spec, job.parent)


@pytest.mark.parametrize("dtype, bf16, gpus, flags, warned", [
    ("float32", True, 0, {"avx512f", "avx512_bf16"}, []),  # autocast on a CPU with bfloat16 instructions: the fit
    ("float32", False, 0, {"avx512f"}, []),
    ("float32", True, 0, {"avx512f"}, ["emulated"]),
    ("float32", True, 0, None, []),  # a machine that cannot tell its flags: no guess
    ("bfloat16", True, 0, {"amx_bf16"}, ["spec.models.actor.dtype bfloat16"]),
    ("bfloat16", True, 0, {"avx2"}, ["emulated", "spec.models.actor.dtype bfloat16"]),
    ("bfloat16", True, 1, {"avx2"}, []),  # GPUs: their bfloat16 is native, and DeepSpeed's bf16 their default
])
def test_a_cpu_job_is_told_what_its_precision_costs_on_this_machine(toy_job, dtype, bf16, gpus, flags, warned):
    from rlhf_trainer.checks import precision_warnings

    job = validate(yaml.safe_load(toy_job(**{"models.actor.dtype": dtype, "training.bf16": bf16,
                                             "resources.gpusPerNode": gpus}).read_text()))
    warnings = precision_warnings(job.spec, flags)
    assert len(warnings) == len(warned) and all(w in text for w, text in zip(warned, warnings)), warnings
    assert all(("set training.bf16: false" in text) or ("set dtype: float32" in text) for text in warnings)
