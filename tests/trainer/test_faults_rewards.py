"""An HTTP reward service that misbehaves: slow, 5xx with and without Retry-After, malformed JSON,
the wrong number of scores. Each is retried with jittered backoff (the waits are computed with an
injected random source and recorded by an injected sleep), then fails naming the source and what
it answered. The service is a real HTTP server on 127.0.0.1 playing a script of answers."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from pathlib import Path

import pytest
from local_http import LocalServer, QuietHandler, read_json, reply

from rlhf_api.v1alpha1 import RewardSpec
from rlhf_trainer.backoff import Backoff, retry_after
from rlhf_trainer.rewards import RewardError, build_reward
from rlhf_trainer.rewards.http import HTTPScorer

pytestmark = pytest.mark.timeout(120)

PROMPTS, COMPLETIONS, LABELS = ["p0", "p1", "p2"], ["a", "bb", "ccc"], [0, 1, 2]
GOOD = [1.5, 2.5, 3.5]  # what a well-behaved service answers: len(completion) + 0.5


class Service(LocalServer):
    """Answers the i-th request with script[i] (the rest correctly):
    ("status", code, Retry-After or None) | ("body", text) | ("slow", seconds) | ("count", n)."""

    def __init__(self, script: list[tuple]):
        self.script, self.requests = list(script), 0
        service = self

        class Handler(QuietHandler):
            def do_POST(self):
                body = read_json(self)
                service.requests += 1
                kind, *args = service.script.pop(0) if service.script else ("ok",)
                rewards = [len(c) + 0.5 for c in body["completions"]]
                if kind == "slow":
                    service.release.wait(args[0])  # longer than the client's timeout
                if kind == "status":
                    code, after = args
                    reply(self, code, {"error": "overloaded"}, {"Retry-After": after} if after else {})
                elif kind == "body":
                    reply(self, 200, args[0])
                elif kind == "count":
                    reply(self, 200, {"rewards": rewards[: args[0]]})
                else:
                    reply(self, 200, {"rewards": rewards})

        super().__init__(Handler)
        self.url += "/score"


@pytest.fixture
def service():
    started = []

    def start(*script: tuple) -> Service:
        started.append(Service(list(script)))
        return started[-1]

    yield start
    for each in started:
        each.close()


def draws(*values: float):
    """A random source that returns values in turn."""
    it = iter(values)
    return lambda: next(it)


def scorer(url: str, sleeps: list, *randoms: float, **options) -> HTTPScorer:
    """An HTTPScorer whose waits are recorded in sleeps instead of slept."""
    backoff = Backoff(base=1.0, cap=60.0, random=draws(*randoms) if randoms else lambda: 0.5)
    return HTTPScorer(url, backoff=backoff, sleep=sleeps.append, **options)


def test_5xx_are_retried_with_exponential_backoff_and_jitter(service):
    svc = service(("status", 503, None), ("status", 500, None), ("status", 502, None))
    sleeps = []
    assert scorer(svc.url, sleeps, 0.5, 0.25, 0.9, retries=3)(PROMPTS, COMPLETIONS, LABELS) == GOOD
    assert sleeps == [0.5 * 1, 0.25 * 2, 0.9 * 4]  # a random share of 1, 2, 4 s
    assert svc.requests == 4


def test_retry_after_is_honoured_as_seconds_or_a_date_and_capped(service):
    later = format_datetime(datetime.now(timezone.utc) + timedelta(seconds=90), usegmt=True)
    svc = service(("status", 503, "7"), ("status", 429, later), ("status", 503, "3600"), ("status", 503, "soon"))
    sleeps = []
    assert scorer(svc.url, sleeps, 0.5, retries=4)(PROMPTS, COMPLETIONS, LABELS) == GOOD
    assert sleeps[0] == 7.0
    assert sleeps[1] == 60.0  # a date 90 s ahead, cut to the 60 s cap
    assert sleeps[2] == 60.0  # an hour asked: the cap
    assert sleeps[3] == 0.5 * 8  # unreadable Retry-After: backoff as if none was sent


def test_retry_after_parses_both_forms():
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert retry_after("120", now=lambda: now) == 120.0
    assert retry_after("Thu, 01 Jan 2026 12:00:30 GMT", now=lambda: now) == 30.0
    assert retry_after("Thu, 01 Jan 2026 11:00:00 GMT", now=lambda: now) == 0.0  # a date already past
    assert retry_after("in a while") is None and retry_after(None) is None and retry_after("") is None


def test_a_slow_service_is_retried_after_its_timeout(service):
    svc = service(("slow", 30))  # the first request gets no answer in time, the second does
    sleeps = []
    # A timeout a busy machine's answer from this process never nears (0.3 s was, under load).
    assert scorer(svc.url, sleeps, timeout=3, retries=2)(PROMPTS, COMPLETIONS, LABELS) == GOOD
    assert svc.requests == 2 and sleeps == [0.5]


def test_malformed_json_is_retried_then_named_with_what_came(service):
    page = "<html><body>502 Bad Gateway</body></html>"
    svc = service(*[("body", page)] * 3)
    sleeps = []
    spec = RewardSpec.model_validate({"sources": [{"name": "judge", "type": "http", "http": {"url": svc.url, "retries": 2}}]})
    reward = build_reward(spec, base_dir=Path("."))
    reward.sources[0][1].sleep = sleeps.append  # the built scorer: record its waits
    with pytest.raises(RewardError) as failure:
        reward.score(PROMPTS, COMPLETIONS, LABELS)
    message = str(failure.value)
    assert message.startswith(f"reward source 'judge' (http {svc.url}) failed: POST {svc.url} failed 3 times")
    assert f"last error: HTTP 200 with malformed JSON: {page!r}" in message
    assert svc.requests == 3 and len(sleeps) == 2


def test_malformed_json_once_is_survived(service):
    svc = service(("body", '{"rewards": [1.0, '))  # cut off mid-answer
    assert scorer(svc.url, [], retries=1)(PROMPTS, COMPLETIONS, LABELS) == GOOD


def test_the_wrong_number_of_scores_is_retried_then_named(service):
    svc = service(("count", 2), ("count", 2))
    with pytest.raises(RuntimeError, match=r'failed 2 times .*last error: HTTP 200 \'{"rewards": \[1.5, 2.5\]}\', '
                                           r'expected {"rewards": \[3 numbers\]}'):
        scorer(svc.url, [], retries=1)(PROMPTS, COMPLETIONS, LABELS)
    assert svc.requests == 2


def test_client_errors_other_than_408_and_429_are_not_retried(service):
    svc = service(("status", 404, None))
    sleeps = []
    with pytest.raises(RuntimeError, match=r"POST .*: HTTP 404 Not Found: {\"error\": \"overloaded\"}"):
        scorer(svc.url, sleeps, retries=3)(PROMPTS, COMPLETIONS, LABELS)
    assert svc.requests == 1 and sleeps == []


def test_the_default_backoff_spreads_retries_and_stays_under_its_cap():
    default = HTTPScorer("http://x").backoff
    worst = Backoff(default.base, default.cap, random=lambda: 1.0)
    assert [worst.delay(k) for k in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    spread = Backoff(random=draws(0.1, 0.7))
    assert [spread.delay(3), spread.delay(3)] == pytest.approx([0.8, 5.6])  # same retry, different waits
