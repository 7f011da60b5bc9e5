"""The status reporter when the API server is away: training never waits for it, updates merge in a
bounded outbox (the newest value of every field wins, none is lost), and all of it arrives once the
server is back. The reporter talks through the real kubernetes client to a real HTTP endpoint on
127.0.0.1 that serves the RLHFJob status subresource and applies JSON merge patches."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from kubernetes import client
from local_http import LocalServer, QuietHandler, read_json, reply

from rlhf_trainer.backoff import Backoff
from rlhf_trainer.kube_status import SENDER_BACKOFF, KubernetesStatusReporter, merge_patches

pytestmark = pytest.mark.timeout(120)

STATUS_PATH = "/apis/rlhf.dev/v1alpha1/namespaces/ns/rlhfjobs/job/status"
QUICK = Backoff(base=0.02, cap=0.1)


def apply_merge_patch(target, patch):
    """RFC 7386, section 2, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


class StatusServer(LocalServer):
    """The status subresource of one RLHFJob: PATCH merges into `job`; `script` answers the first
    requests otherwise ((status, Retry-After or None), or "hold": wait for `release` first)."""

    def __init__(self, port: int = 0, script: list | None = None):
        self.job = {"status": {"phase": "Running"}}  # the operator's field: patches must leave it
        self.patches: list[dict] = []  # bodies taken (answered 200)
        self.requests = 0
        self.script = list(script or [])
        self.held = threading.Event()
        server = self

        class Handler(QuietHandler):
            def do_PATCH(self):
                body = read_json(self)
                assert self.path == STATUS_PATH and self.headers["Content-Type"] == "application/merge-patch+json"
                server.requests += 1
                step = server.script.pop(0) if server.script else None
                if step == "hold":
                    server.held.set()
                    server.release.wait(60)
                elif step is not None:
                    status, retry_after = step
                    reply(self, status, {}, {"Retry-After": retry_after} if retry_after else {})
                    return
                server.patches.append(body)
                server.job = apply_merge_patch(server.job, body)
                reply(self, 200, server.job)

        super().__init__(Handler, port)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def reporters():
    """reporters(port, **options) -> a reporter of RLHFJob ns/job at 127.0.0.1:port, closed after the test."""
    made = []

    def make(port: int, **options) -> KubernetesStatusReporter:
        configuration = client.Configuration()
        configuration.host = f"http://127.0.0.1:{port}"
        api_client = client.ApiClient(configuration)
        options = {"min_interval": 0.0, "backoff": QUICK, **options}
        made.append((KubernetesStatusReporter("job", "ns", client.CustomObjectsApi(api_client), **options), api_client))
        return made[-1][0]

    yield make
    for reporter, api_client in made:
        reporter.close()
        api_client.close()


@pytest.fixture
def servers():
    started = []

    def start(**options) -> StatusServer:
        started.append(StatusServer(**options))
        return started[-1]

    yield start
    for server in started:
        server.close()


def train(reporter: KubernetesStatusReporter, steps: range) -> None:
    """What the training loop does: a log per step, a checkpoint every fourth."""
    for step in steps:
        reporter.log(step, {"reward_mean": step / 10, "kl": step / 100})
        if step % 4 == 0:
            reporter.checkpoint(step, f"/ckpt/step-{step}")


def test_training_calls_return_while_a_patch_hangs_and_the_newest_state_follows(servers, reporters):
    server = servers(script=["hold"])  # the first patch gets no answer until released
    reporter = reporters(server.port, request_timeout=60, finish_timeout=0.1)
    reporter.start(total_steps=20)
    assert server.held.wait(30), "the first patch reached the server"
    train(reporter, range(1, 21))  # had any of these waited for the network, this would hang here
    reporter.finish("succeeded")  # finish waits, but only finish_timeout for what is still pending
    assert server.patches == [], "all of it returned while the first patch hung"

    server.release.set()
    assert reporter.wait(30)
    first, rest = server.patches[0], server.patches[1:]
    assert first["status"]["progress"]["step"] == 0
    assert len(rest) == 1, "twenty steps' updates went out as one merged patch"
    status = server.job["status"]
    assert status["phase"] == "Running"  # the operator's fields are left alone
    assert status["progress"]["step"] == 20 and status["progress"]["result"] == "Succeeded"
    assert status["metrics"] == {"rewardMean": 2.0, "kl": 0.2}
    assert status["lastCheckpoint"]["step"] == 20 and status["lastCheckpoint"]["path"] == "/ckpt/step-20"


def test_an_api_server_that_refuses_then_comes_back_gets_every_field(servers, reporters, caplog):
    port = free_port()  # nothing listens yet: connections are refused
    reporter = reporters(port)
    reporter.start(total_steps=10)
    train(reporter, range(1, 5))  # a checkpoint at step 4 ...
    train(reporter, range(5, 8))  # ... then steps without one: the checkpoint must survive them
    assert not reporter.wait(timeout=0.5)  # nothing could be delivered

    server = servers(port=port)
    assert reporter.wait(timeout=30)
    assert len(server.patches) == 1, "what piled up went as one patch"
    status = server.job["status"]
    assert status["progress"]["step"] == 7 and status["progress"]["summary"] == "7/10"
    assert status["metrics"] == {"rewardMean": 0.7, "kl": 0.07}
    assert status["lastCheckpoint"]["step"] == 4
    assert "retrying in the background" in caplog.text


class RecordingBackoff:
    """Backoff.delay, recording what it was asked; waits a hundredth of the real delay."""

    def __init__(self):
        self.calls: list[tuple[int, float | None]] = []

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        self.calls.append((retry, retry_after))
        return QUICK.delay(retry, None if retry_after is None else retry_after / 100)


def test_retry_after_of_an_overloaded_api_server_is_honoured(servers, reporters):
    server = servers(script=[(429, "7"), (503, None), (500, "3")])
    backoff = RecordingBackoff()
    reporter = reporters(server.port, backoff=backoff)
    reporter.start(total_steps=4)
    assert reporter.wait(30)
    assert backoff.calls == [(0, 7.0), (1, None), (2, 3.0)]
    assert server.requests == 4 and server.job["status"]["progress"]["summary"] == "0/4"


def test_a_patch_the_server_refuses_for_good_is_dropped_and_the_next_goes_through(servers, reporters, caplog):
    server = servers(script=[(422, None)])  # e.g. a value the schema rejects: no retry can fix it
    reporter = reporters(server.port)
    reporter.start(total_steps=4)
    assert reporter.wait(30)
    assert server.patches == [] and "refused a status update, dropped" in caplog.text
    reporter.log(1, {"reward_mean": 1.0})
    assert reporter.wait(30)
    assert server.job["status"]["progress"]["step"] == 1


def test_finish_gives_up_waiting_after_its_timeout(reporters, caplog):
    caplog.set_level(logging.WARNING)
    reporter = reporters(free_port(), finish_timeout=0.2)
    reporter.start(total_steps=1)
    reporter.finish("failed", "boom")  # returns, though nothing could be delivered
    assert "was not delivered within 0.2s" in caplog.text


def test_the_sender_retries_at_most_ten_seconds_apart():
    """With the worst draw every time, a server back from an outage hears from us within 10 s."""
    worst = Backoff(SENDER_BACKOFF.base, SENDER_BACKOFF.cap, random=lambda: 1.0)
    assert [worst.delay(k) for k in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert worst.delay(3, retry_after=120) == 10.0  # a Retry-After longer than the cap is cut to it
    assert Backoff(SENDER_BACKOFF.base, SENDER_BACKOFF.cap, random=lambda: 0.25).delay(2) == 0.5


@pytest.mark.parametrize(("older", "newer"), [
    ({"progress": {"step": 1, "result": None}, "metrics": {"kl": 1.0}}, {"progress": {"step": 2}}),
    ({"progress": {"step": 3, "result": "Succeeded"}}, {"progress": {"step": 0, "result": None}}),
    ({"lastCheckpoint": {"step": 4}}, {"progress": {"result": "Failed"}, "metrics": {"rewardMean": 0.5}}),
    ({"progress": {"step": 2, "result": None}}, {"progress": {"result": "Failed"}}),
])
def test_merged_updates_do_what_sending_both_would(older, newer):
    current = {"phase": "Running", "progress": {"step": 0, "totalSteps": 9}, "metrics": {"kl": 0.5, "loss": 2.0}}
    assert apply_merge_patch(current, merge_patches(older, newer)) == apply_merge_patch(apply_merge_patch(current, older), newer)
