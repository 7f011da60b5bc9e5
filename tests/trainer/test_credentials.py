"""Credentials a job holds stay with the servers they are for: the reward token is not re-sent where
a redirect points, and URLs' user:password and query, and literal environment values, stay out of
error messages (the RayJob's message becomes the RLHFJob's status.message and Events) and of the
trackers' run config. The services are real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import pytest
from local_http import LocalServer, QuietHandler, read_json, reply

from rlhf_api.v1alpha1 import RewardSource
from rlhf_api.validation import validate
from rlhf_trainer.backoff import Backoff
from rlhf_trainer.environments import describe
from rlhf_trainer.environments.http import JSONClient
from rlhf_trainer.reporting import RunInfo
from rlhf_trainer.rewards import Reward, RewardError
from rlhf_trainer.rewards.http import HTTPScorer

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"
NO_WAIT = Backoff(base=0.0, cap=0.0)


class Recorder(LocalServer):
    """Answers every request with `answer(handler)` and records (method, path, Authorization)."""

    def __init__(self, answer):
        self.seen: list[tuple[str, str, str | None]] = []
        recorder = self

        class Handler(QuietHandler):
            def _handle(self):
                recorder.seen.append((self.command, self.path, self.headers.get("Authorization")))
                answer(self)

            do_GET = do_POST = _handle

        super().__init__(Handler)


@pytest.fixture
def servers():
    started: list[Recorder] = []

    def start(answer) -> Recorder:
        started.append(Recorder(answer))
        return started[-1]

    yield start
    for each in started:
        each.close()


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_is_not_followed_and_the_token_stays_home(servers, code):
    elsewhere = servers(lambda h: reply(h, 200, {"rewards": [1.0]}))
    service = servers(lambda h: (read_json(h), reply(h, code, "", {"Location": f"{elsewhere.url}/steal"})))
    scorer = HTTPScorer(f"{service.url}/score", token=TOKEN, retries=2, backoff=NO_WAIT, sleep=lambda s: None)
    with pytest.raises(RuntimeError, match=f"HTTP {code}.*redirect.*not followed.*set the url to"):
        scorer(["p"], ["c"], [None])
    assert service.seen == [("POST", "/score", f"Bearer {TOKEN}")]  # once: a redirect is not retried
    assert elsewhere.seen == []


def test_error_messages_show_no_url_credentials(servers):
    service = servers(lambda h: (read_json(h), reply(h, 404, {"error": "no such model"})))
    url = f"http://127.0.0.1:{service.port}/score?api_key=k3y&model=m"
    source = RewardSource.model_validate({"name": "h", "type": "http", "http": {"url": url}})
    with pytest.raises(RewardError) as refused:  # a 4xx: the reward's message around jsonpost's
        Reward([(source, HTTPScorer(url, retries=0))]).score(["p"], ["c"])
    with pytest.raises(RuntimeError) as unreachable:  # retries used up: jsonpost's other message
        JSONClient("http://user:hunter2@127.0.0.1:9/x?token=k3y", timeout=5, retries=0).post({"action": "reset"})
    environment = validate(_job(environment={"type": "http", "http": {"url": url}})).spec.environment
    messages = [str(refused.value), str(unreachable.value), describe(environment)]
    for message in messages:
        assert "hunter2" not in message and "k3y" not in message, message
    assert f"127.0.0.1:{service.port}/score" in messages[0] and "HTTP 404" in messages[0]  # still says where and what


def test_the_trackers_config_shows_no_env_values_or_url_credentials(tmp_path):
    job = validate(_job(
        reward={"sources": [{"name": "h", "type": "http", "http": {"url": "https://u:hunter2@rm.example/score?key=k3y"}}]},
        resources={"env": [{"name": "HF_ENDPOINT", "value": "https://mirror.example/?token=k3y"},
                           {"name": "WANDB_NOTES", "value": "hunter2"},
                           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}]},
        tracking={"mlflow": {"trackingUri": "https://u:hunter2@mlflow.example"}}))
    config = RunInfo.of(job, tmp_path, "j").config
    shown = str(config)
    assert "hunter2" not in shown and "k3y" not in shown, shown
    assert config["reward"]["sources"][0]["http"]["url"].endswith("@rm.example/score?REDACTED")
    assert [e["name"] for e in config["resources"]["env"]] == ["HF_ENDPOINT", "WANDB_NOTES", "HF_TOKEN"]
    assert config["resources"]["env"][2]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}  # a reference


def _job(**spec):
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "j", "namespace": "t"},
            "spec": {"algorithm": "grpo", "models": {"actor": {"path": "m"}}, "rollout": {"samplesPerPrompt": 2},
                     "data": {"prompts": {"sources": [{"path": "p.jsonl"}]}},
                     "reward": {"sources": [{"name": "len", "type": "function", "function": {"entrypoint": "r.py:f"}}]},
                     **spec}}
