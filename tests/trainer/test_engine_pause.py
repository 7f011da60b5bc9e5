"""The engine actor's pause protocol (workers/rollout.py) against every interleaving that matters, made to
happen: a pause that lands between `generate`'s wait for the engine to be unpaused and its taking the
lock (the whole suite under load hung there: a step with every request taken out waits forever for an
engine core in its own process). vLLM's engine is a stand-in here, one that behaves like a core in its own
process; the real engine with a real sync: test_weight_sync.py's partial rollout."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from e2e.fixtures import wait_for
from rlhf_trainer.workers.rollout import RolloutEngine


class CoreInItsOwnProcess:
    """vLLM's LLMEngine as the actor drives it: a step returns each request's next token (7, log-prob -0.5);
    with an engine core in its own process a step with no request would wait for output forever."""

    def __init__(self):
        self.left: dict[str, int] = {}  # request id -> tokens still to sample

    def add_request(self, request_id, prompt, params) -> None:
        self.left[request_id] = params.max_tokens

    def abort_request(self, request_ids) -> None:
        for request_id in request_ids:
            self.left.pop(request_id, None)

    def step(self) -> list:
        assert self.left, "a step with no request in flight: an engine core in its own process never answers it"
        outputs = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            finished = self.left[request_id] == 0
            if finished:
                del self.left[request_id]
            sample = SimpleNamespace(token_ids=[7], logprobs=[{7: SimpleNamespace(logprob=-0.5)}],
                                     finish_reason="length" if finished else None)
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished, outputs=[sample]))
        return outputs


class PausedRightAfterTheWait(threading.Event):
    """The engine's `unpaused`: its second wait, once it has returned, lets a pause run to its end before the
    waiting thread goes on (to take the lock)."""

    def __init__(self, engine: RolloutEngine):
        super().__init__()
        self.set()
        self.engine, self.waits = engine, 0

    def wait(self, timeout=None) -> bool:
        unpaused = super().wait(timeout)
        self.waits += 1
        if self.waits == 2:
            pausing = threading.Thread(target=self.engine.pause)
            pausing.start()
            pausing.join()
        return unpaused


def test_a_pause_between_the_wait_and_the_lock_loses_nothing_and_blocks_nothing():
    engine = RolloutEngine.__new__(RolloutEngine)  # its own methods, on the stand-in engine
    engine.llm = SimpleNamespace(llm_engine=CoreInItsOwnProcess())
    engine.threads, engine.seeds_requests, engine.seed, engine.requests = torch.get_num_threads(), False, 0, 0
    engine.logit_bias = None  # a text model: no token is kept from sampling
    engine._track_requests()
    engine.unpaused = PausedRightAfterTheWait(engine)

    with ThreadPoolExecutor(1) as pool:
        rollout = pool.submit(engine.generate, [[1, 2, 3]], {"n": 2, "max_tokens": 4})
        wait_for(lambda: engine.held or rollout.done(), 30, "the pause")
        assert not rollout.done(), rollout.result()
        assert len(engine.held) == 2 and not engine.llm.llm_engine.left
        engine.resume(1)
        completions, _ = rollout.result(timeout=30)
    for sample in completions[0]:
        assert sample.token_ids == [7] * 4 and sample.truncated  # the budget, no token lost or repeated
        assert sample.versions == [0, 1, 1, 1]  # one step before the pause, the rest after
