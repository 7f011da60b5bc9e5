"""Rewards: Python functions (files, modules, ConfigMaps), a real HTTP service, a reward model, weights and clipping."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml
from local_http import LocalServer, QuietHandler, read_json, reply

from rlhf_api import contract
from rlhf_api.validation import validate
from rlhf_api.v1alpha1 import RewardSpec, StepReward
from rlhf_trainer.rewards import RewardError, RewardModelScorer, build_reward
from rlhf_trainer.rewards import function as function_rewards
from rlhf_trainer.backoff import Backoff
from rlhf_trainer.rewards.http import HTTPScorer
from rlhf_trainer.tiny import build_tiny_model

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
PROMPTS = ["p0", "p1", "p2", "p3", "p4"]
COMPLETIONS = ["a", "bb", "ccc", "dddd", "eeeee"]
LABELS = [0, 1, 2, 3, 4]
FAST = Backoff(base=0.01, cap=0.05)  # retries without waiting long


@pytest.fixture(autouse=True)
def isolated_import_path(monkeypatch):
    """Reward files put their folder on sys.path; keep that within each test (module names differ per test)."""
    monkeypatch.setattr(sys, "path", list(sys.path))


def spec(*sources: dict, clip: float | None = None) -> RewardSpec:
    return RewardSpec.model_validate({"sources": list(sources), "clip": clip})


def function_source(name: str, entrypoint: str, weight: float = 1.0, config_map: str | None = None) -> dict:
    function = {"entrypoint": entrypoint} | ({"configMap": config_map} if config_map else {})
    return {"name": name, "type": "function", "weight": weight, "function": function}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


LENGTH_REWARD = "def score(prompts, completions, labels):\n    return [float(len(c)) for c in completions]\n"


# ------------------------------------------------------------------------------------ functions


def test_function_from_a_file_next_to_the_job(tmp_path):
    write(tmp_path / "length.py", LENGTH_REWARD)
    result = build_reward(spec(function_source("length", "length.py:score")), base_dir=tmp_path).score(PROMPTS, COMPLETIONS, LABELS)
    assert result.total.dtype == torch.float32 and result.total.tolist() == [1, 2, 3, 4, 5]
    assert list(result.by_source) == ["length"]


def test_function_in_a_subfolder_imports_its_neighbours(tmp_path):
    write(tmp_path / "rewards" / "scoring_helpers.py", "def bonus(label):\n    return 10 * label\n")
    write(tmp_path / "rewards" / "check.py",
          "from scoring_helpers import bonus\n\ndef score(prompts, completions, labels):\n"
          "    return [bonus(l) + (p == 'p0') for p, l in zip(prompts, labels)]\n")
    reward = build_reward(spec(function_source("check", "rewards/check.py:score")), base_dir=tmp_path)
    assert reward.score(PROMPTS, COMPLETIONS, LABELS).total.tolist() == [1, 10, 20, 30, 40]


def test_function_from_an_importable_module(tmp_path, monkeypatch):
    write(tmp_path / "site" / "my_rewards" / "__init__.py", "")
    write(tmp_path / "site" / "my_rewards" / "exact.py",
          "def match(prompts, completions, labels):\n    return [c == str(l) for c, l in zip(completions, labels)]\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    reward = build_reward(spec(function_source("exact", "my_rewards.exact:match")), base_dir=tmp_path / "elsewhere")
    assert reward.score(["q", "q"], ["7", "8"], [7, 9]).total.tolist() == [1.0, 0.0]  # bools count as 0/1


def test_function_from_its_configmap_mount(tmp_path, monkeypatch):
    monkeypatch.setattr(function_rewards, "FUNCTIONS_DIR", tmp_path / "etc-rlhf-rewards")
    write(tmp_path / "etc-rlhf-rewards" / "math" / "math_reward.py", LENGTH_REWARD)
    write(tmp_path / "etc-rlhf-rewards" / "math" / "cm_helpers.py", "SCALE = 3\n")
    write(tmp_path / "etc-rlhf-rewards" / "scaled" / "scaled.py",
          "from cm_helpers import SCALE\n\ndef score(prompts, completions, labels):\n    return [SCALE] * len(prompts)\n")
    write(tmp_path / "job" / "math_reward.py", "def score(p, c, l):\n    return [-1.0] * len(p)\n")  # not this one
    reward = build_reward(
        spec(function_source("math", "math_reward.py:score", config_map="math-reward"),
             function_source("scaled", "scaled:score", config_map="scaled-reward")),
        base_dir=tmp_path / "job",
    )
    result = reward.score(PROMPTS[:2], COMPLETIONS[:2], LABELS[:2])
    assert result.by_source["math"].tolist() == [1, 2] and result.by_source["scaled"].tolist() == [3, 3]


def test_prompts_completions_and_labels_reach_the_function(tmp_path):
    write(tmp_path / "echo.py", "seen = []\n\ndef score(prompts, completions, labels):\n"
          "    seen.append((prompts, completions, labels))\n    return [0.0] * len(prompts)\n")
    build_reward(spec(function_source("echo", "echo.py:score")), base_dir=tmp_path).score(PROMPTS, COMPLETIONS, LABELS)
    assert sys.modules["rlhf_reward_echo"].seen == [(PROMPTS, COMPLETIONS, LABELS)]
    build_reward(spec(function_source("echo", "echo.py:score")), base_dir=tmp_path).score(["p"], ["c"])
    assert sys.modules["rlhf_reward_echo"].seen == [(["p"], ["c"], [None])]  # no labels in the dataset


def test_weights_sum(tmp_path):
    write(tmp_path / "length.py", LENGTH_REWARD)
    write(tmp_path / "minus.py", "import numpy as np\n\ndef score(p, c, l):\n    return -np.ones(len(p))\n")
    two = [function_source("length", "length.py:score", weight=2.0), function_source("minus", "minus.py:score", weight=0.5)]
    result = build_reward(spec(*two), base_dir=tmp_path).score(PROMPTS, COMPLETIONS, LABELS)
    assert result.total.tolist() == [1.5, 3.5, 5.5, 7.5, 9.5]
    assert result.by_source["length"].tolist() == [1, 2, 3, 4, 5] and result.by_source["minus"].tolist() == [-1] * 5
    assert result.task.tolist() == result.total.tolist()  # reward.clip bounds the shaped total (test_length_shaping)


@pytest.mark.parametrize(("body", "message"), [
    ("return [1.0] * (len(c) - 1)", "returned 4 scores for 5 completions: return one per completion"),
    ("return ['1.0'] * len(c)", r"returned '1.0' \(str\) at index 0: scores must be numbers"),
    ("return [None] * len(c)", r"returned None \(NoneType\) at index 0: scores must be numbers"),
    ("return 1.0", "returned float: return a list with one float per completion"),
    ("return torch.ones(len(c), 1)", r"returned an array of shape \(5, 1\): return one score per completion, shape \[5\]"),
    ("return [float('nan')] + [0.0] * (len(c) - 1)", "returned nan at index 0: scores must be finite"),
    ("raise KeyError('answer')", "failed: 'answer'"),
])
def test_a_misbehaving_function_is_named_in_the_error(tmp_path, body, message):
    write(tmp_path / "bad.py", f"import torch\n\ndef score(p, c, l):\n    {body}\n")
    reward = build_reward(spec(function_source("bad-one", "bad.py:score")), base_dir=tmp_path)
    with pytest.raises(RewardError, match=r"reward source 'bad-one' \(function bad.py:score\) " + message):
        reward.score(PROMPTS, COMPLETIONS, LABELS)


def test_tensors_and_arrays_are_accepted(tmp_path):
    write(tmp_path / "t.py", "import torch\n\ndef score(p, c, l):\n    return torch.arange(len(p), dtype=torch.float64)\n")
    assert build_reward(spec(function_source("t", "t.py:score")), base_dir=tmp_path).score(PROMPTS, COMPLETIONS, LABELS).total.tolist() == [0, 1, 2, 3, 4]


def test_missing_file_or_function_fails_when_built(tmp_path):
    with pytest.raises(RewardError, match=r"reward source 'r' \(function nope.py:score\): .*nope.py does not exist \(relative paths start at the job file's directory\): fix function.entrypoint"):
        build_reward(spec(function_source("r", "nope.py:score")), base_dir=tmp_path)
    write(tmp_path / "length.py", LENGTH_REWARD)
    with pytest.raises(RewardError, match="has no function 'reward': fix function.entrypoint"):
        build_reward(spec(function_source("r", "length.py:reward")), base_dir=tmp_path)
    with pytest.raises(RewardError, match="No module named 'no_such_rewards'"):
        build_reward(spec(function_source("r", "no_such_rewards:score")), base_dir=tmp_path)


def test_inputs_of_different_lengths_are_refused(tmp_path):
    write(tmp_path / "length.py", LENGTH_REWARD)
    reward = build_reward(spec(function_source("length", "length.py:score")), base_dir=tmp_path)
    with pytest.raises(ValueError, match="got 2 prompts, 1 completions and 2 labels"):
        reward.score(["a", "b"], ["c"], [1, 2])


# ------------------------------------------------------------------------------------------- http


class RewardService(LocalServer):
    """A real HTTP reward service on 127.0.0.1: fails the first `failures` requests with `status`."""

    def __init__(self, failures: int = 0, status: int = 503, hang: bool = False):
        self.failures, self.status, self.hang = failures, status, hang
        self.requests: list[tuple[dict, dict]] = []  # (headers, body)
        service = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = read_json(self)
                service.requests.append((dict(self.headers), body))
                if service.hang:
                    service.release.wait(10)
                    return
                if len(service.requests) <= service.failures:
                    reply(self, service.status, {"error": "overloaded" if service.status >= 500 else "labels must be strings"})
                else:
                    reply(self, 200, {"rewards": [len(c) + 0.5 for c in body["completions"]]})

        super().__init__(Handler)
        self.url += "/score"


@pytest.fixture
def services():
    started = []

    def start(**behaviour) -> RewardService:
        started.append(RewardService(**behaviour))
        return started[-1]

    yield start
    for service in started:
        service.close()


def test_http_retries_5xx_then_scores_in_batches(services):
    service = services(failures=2)
    scorer = HTTPScorer(service.url, batch_size=2, retries=3, backoff=FAST)
    assert scorer(PROMPTS, COMPLETIONS, LABELS) == [1.5, 2.5, 3.5, 4.5, 5.5]
    bodies = [body for _, body in service.requests]
    assert len(bodies) == 2 + 3  # two failures, then three batches
    assert bodies[0] == bodies[1] == bodies[2] == {"prompts": PROMPTS[:2], "completions": COMPLETIONS[:2], "labels": LABELS[:2]}
    assert bodies[4] == {"prompts": PROMPTS[4:], "completions": COMPLETIONS[4:], "labels": LABELS[4:]}


def test_http_gives_up_after_its_retries(services):
    service = services(failures=10)
    with pytest.raises(RuntimeError, match=r"failed 3 times .*last error: HTTP 503 Service Unavailable: {\"error\": \"overloaded\"}"):
        HTTPScorer(service.url, retries=2, backoff=FAST)(PROMPTS, COMPLETIONS, LABELS)
    assert len(service.requests) == 3


def test_http_client_errors_are_not_retried(services):
    service = services(failures=1, status=400)
    with pytest.raises(RuntimeError, match='HTTP 400 Bad Request: {"error": "labels must be strings"}'):
        HTTPScorer(service.url, retries=3, backoff=FAST)(PROMPTS, COMPLETIONS, LABELS)
    assert len(service.requests) == 1


def test_http_timeouts_are_retried(services):
    service = services(hang=True)
    with pytest.raises(RuntimeError, match=r"failed 2 times \(timeout 0.2s\)"):
        HTTPScorer(service.url, timeout=0.2, retries=1, backoff=FAST)(PROMPTS, COMPLETIONS, LABELS)
    assert len(service.requests) == 2


def test_http_connection_refused_is_reported_with_the_source(services):
    service = services()
    service.close()  # nothing listens there any more
    source = {"name": "judge", "type": "http", "http": {"url": service.url, "retries": 0}}
    with pytest.raises(RewardError, match=r"reward source 'judge' \(http http://127.0.0.1:\d+/score\) failed: POST .* failed 1 times"):
        build_reward(spec(source), base_dir=Path(".")).score(PROMPTS, COMPLETIONS, LABELS)


def test_http_source_sends_its_token_and_is_weighted(services, monkeypatch):
    service = services()
    monkeypatch.setenv(contract.reward_token_env("my-judge"), "s3cret")
    source = {"name": "my-judge", "type": "http", "weight": 2.0, "http": {"url": service.url, "batchSize": 4}}
    result = build_reward(spec(source), base_dir=Path(".")).score(PROMPTS, COMPLETIONS, LABELS)
    assert result.total.tolist() == [3.0, 5.0, 7.0, 9.0, 11.0]
    assert [len(body["prompts"]) for _, body in service.requests] == [4, 1]
    assert all(headers["Authorization"] == "Bearer s3cret" for headers, _ in service.requests)


def test_http_without_token_sends_no_authorization(services, monkeypatch):
    service = services()
    monkeypatch.delenv("RLHF_REWARD_JUDGE_TOKEN", raising=False)
    source = {"name": "judge", "type": "http", "http": {"url": service.url}}
    build_reward(spec(source), base_dir=Path(".")).score(["p"], ["c"], [None])
    assert "Authorization" not in service.requests[0][0]


# ------------------------------------------------------------------------------------------ model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("jobdir") / "rm", kind="reward")


def test_reward_model_scores_prompt_plus_completion(reward_model_dir):
    scorer = RewardModelScorer(str(reward_model_dir), batch_size=2)
    scores = scorer(PROMPTS, COMPLETIONS)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    assert len(set(scores.tolist())) == 5
    # batching and padding do not change a score: one at a time gives the same
    torch.testing.assert_close(RewardModelScorer(str(reward_model_dir), batch_size=1)(PROMPTS, COMPLETIONS), scores)
    # it is the classifier's output on prompt + completion + eos
    tokens = scorer.tokenizer(["p3dddd<|im_end|>"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        torch.testing.assert_close(scorer.model.classifier(**tokens).logits[0, 0], scores[3])
    assert scorer([], []).shape == (0,)


def test_model_source_uses_the_scorer_it_is_given(tmp_path):
    calls = []

    def remote_scorer(prompts, completions, steps):  # e.g. a Ray actor's score call
        calls.append((prompts, completions, steps))
        return torch.tensor([10.0] * len(prompts))

    write(tmp_path / "length.py", LENGTH_REWARD)
    reward = build_reward(
        spec({"name": "rm", "type": "model"}, function_source("length", "length.py:score")),
        base_dir=tmp_path, model_scorer=remote_scorer,
    )
    assert reward.score(PROMPTS, COMPLETIONS, LABELS).total.tolist() == [11, 12, 13, 14, 15]
    assert calls == [(PROMPTS, COMPLETIONS, None)]
    # a process reward model's source hands the scorer its steps
    reward = build_reward(spec({"name": "prm", "type": "model", "steps": {"aggregation": "product"}}),
                          base_dir=tmp_path, model_scorer=remote_scorer)
    reward.score(PROMPTS, COMPLETIONS, LABELS)
    assert calls[-1][2] == StepReward(aggregation="product")


def test_model_source_without_a_model_is_refused(tmp_path):
    with pytest.raises(RewardError, match="needs spec.models.reward"):
        build_reward(spec({"name": "rm", "type": "model"}), base_dir=tmp_path)


# ---------------------------------------------------------------------------------- the toy task


def test_toy_reward_of_the_tiny_example_job():
    job = validate(yaml.safe_load((EXAMPLES / "tiny-grpo-cpu-job.yaml").read_text()))
    reward = build_reward(job.spec.reward, base_dir=EXAMPLES)
    completions = ["cccc", "c c c", "cccccccc", "ccxx", "xyz", "", "CCCC"]
    scores = reward.score(["Repeat the letter c."] * len(completions), completions, ["c"] * len(completions)).total
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
