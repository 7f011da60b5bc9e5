"""After a weight sync, every engine's greedy output and log-probs equal Hugging Face's of the updated
actor, also for prompts whose KV the engines had cached before the update; a ZeRO-3 actor on two gloo
ranks gathers its weights in buckets and sends them to two vLLM engines by each route of
transfer_plan.py: engines on bundles of their own over a gloo broadcast group from actor rank 0,
engines on the actor's bundles (training.colocation: all) through shared-memory handles from the
rank on their bundle; and to one engine of two tensor-parallel workers (vLLM's multiprocessing
executor, as on GPUs), each sent its weights. Each engine's core runs in a process of its own, as on a
GPU: every call and argument of the sync crosses a process boundary (msgpack), as it does there."""

from __future__ import annotations

from datetime import timedelta

import psutil
import pytest
import ray
from ray.util.placement_group import remove_placement_group
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import ModelSpec, RolloutSpec, TrainingSpec
from e2e.fixtures import wait_for
from rlhf_trainer.experience import Experience
from rlhf_trainer.workers.group import ModelGroup, create_placement_group, create_rollout_engines
from rlhf_trainer.workers.engine import ModelConfig
from rlhf_trainer.workers.rollout import ENGINE_PROCESS_ENV, engine_env
from rlhf_trainer.workers.transfer_plan import BROADCAST, HANDLES, Route
from rlhf_trainer.workers.weight_sync import Handles, setup_weight_sync, sync_weights

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def engine_core_in_its_own_process(monkeypatch):
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "own")

# Asked before and after the update: vLLM's prefix cache keeps the KV of each prompt's whole blocks
# (the last prompt, 208 tokens, spans several), and an engine that kept its cache would serve them
# after the update (without reset_prefix_cache this test fails).
PROMPTS = ["Ada: Repeat the letter c.", "Bo: Say f.", "Cy: Type a many times.",
           "Di: " + "Spell b, then d, then e. " * 12]
GREEDY = {"n": 1, "temperature": 0.0, "max_tokens": 12}
# The tiny model's weights are 0.6-197 KiB each (1.3 MiB in all): 64 KiB buckets give several weights to
# a bucket, the larger weights one alone, and more buckets than a handle sender keeps unopened.
BUCKET_BYTES = 64 << 10
# placement -> (its ranks, bundles, the engines' tensor-parallel width, the route every vLLM worker takes)
PLACEMENTS = {"separate": ({"actor": [0, 1], "rollout": [2, 3]}, 4, 1, BROADCAST),
              "colocated": ({"actor": [0, 1], "rollout": [0, 1]}, 2, 1, HANDLES),
              "tensor-parallel": ({"actor": [0, 1], "rollout": [2]}, 4, 2, BROADCAST)}


def _hf_greedy(model_dir, prompt_ids: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for ids in prompt_ids:
        generated = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY["max_tokens"], do_sample=False)
        outputs.append(generated[0, len(ids):].tolist())
    return outputs


def _hf_log_probs(model_dir, prompt_ids: list[list[int]], outputs: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    log_probs = []
    for ids, output in zip(prompt_ids, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([ids + output])).logits[0, len(ids) - 1:-1]
        log_probs.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0])
    return log_probs


def _vllm_greedy(engine, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    completions, _ = ray.get(engine.generate.remote(prompt_ids, GREEDY))
    return [s[0].token_ids for s in completions], [torch.tensor(s[0].log_probs) for s in completions]


def _chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def _update(actor: ModelGroup, tokenizer, prompt_ids: list[list[int]], outputs: list[list[int]]) -> None:
    """One large update with negative advantages on the tokens the greedy decode chose, so that the
    greedy output changes."""
    rows = [ids + out for ids, out in zip(prompt_ids, outputs)]
    width = max(map(len, rows))
    sequences = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    attention_mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    actions = GREEDY["max_tokens"]
    experience = Experience(
        sequences=sequences, attention_mask=attention_mask,
        action_mask=torch.ones(len(rows), actions, dtype=torch.bool),
        action_log_probs=actor.forward(sequences, attention_mask, actions),
        advantages=-torch.ones(len(rows), actions),
    )
    ray.get(actor.train(experience, train_batch_size=4, micro_batch_size=2, epochs=1,
                        generator=torch.Generator().manual_seed(0)))


def test_the_engine_process_is_vllm_s_choice_on_gpu_and_an_unknown_one_is_refused(monkeypatch):
    assert engine_env(use_gpu=False)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # "own", this module's
    assert engine_env(use_gpu=True) == {}
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "gpu")
    with pytest.raises(ValueError, match=f"{ENGINE_PROCESS_ENV}='gpu': use one of actor, own"):
        engine_env(use_gpu=False)


def test_a_handle_carries_the_tensors_shared_memory_not_its_bytes():
    """The colocated route on CPU: what travels through the store is a reference to the sender's
    shared memory (a few hundred bytes for a 4 MB bucket), and it opens as the sent values."""
    from torch.distributed import HashStore

    route = Route(engine=0, worker=0, bundle=0, sender=0, via=HANDLES)
    store = HashStore()
    store.set_timeout(timedelta(seconds=30))  # a key never set fails the test soon
    sender, receiver = Handles(store, route, torch.device("cpu")), Handles(store, route, torch.device("cpu"))
    bucket = torch.arange(1 << 20, dtype=torch.float32)
    sender.send(bucket)
    assert len(sender.store.get("0")) < 1024  # bucket 0 as published
    received = receiver.receive(bucket.numel(), bucket.dtype)
    assert received.is_shared() and torch.equal(received, bucket)
    sender.done()  # the receiver confirmed the bucket: the sender holds nothing more


@pytest.mark.parametrize("placed", PLACEMENTS)
def test_vllm_serves_the_updated_actor(placed, tiny_model, local_ray, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = [_chat_ids(tokenizer, p) for p in PROMPTS]

    ranks, bundles, width, route = PLACEMENTS[placed]
    placement = Placement(use_gpu=False, bundles=bundles, ranks=ranks, engine_width=width)
    group = create_placement_group(placement)
    actor = ModelGroup("actor", group, placement)
    training = TrainingSpec(zero_stage=3, bf16=False, learning_rate=0.05, lr_warmup_ratio=0, lr_scheduler="constant",
                            train_batch_size=4, micro_train_batch_size=2, micro_rollout_batch_size=4)
    model = ModelSpec(path=str(tiny_model), dtype="float32")
    engines = create_rollout_engines(group, placement, str(tiny_model), rollout=RolloutSpec(tensor_parallel_size=width),
                                     dtype="float32", max_model_len=256, seed=0)
    ray.get(actor.setup(ModelConfig(role="actor", path=str(tiny_model), model=model, training=training,
                                    optimizer_steps=2)))
    for engine in engines:  # the engine core runs in a child of the actor's process
        assert ray.get(engine.__ray_call__.remote(lambda self: [child.pid for child in psutil.Process().children()]))
    weight_sync = setup_weight_sync(actor, engines, placement, bucket_bytes=BUCKET_BYTES)
    assert [r.via for r in weight_sync.routes] == [route] * len(engines) * width  # one per vLLM worker
    before = [_vllm_greedy(engine, prompt_ids)[0] for engine in engines]
    assert before == [_hf_greedy(tiny_model, prompt_ids)] * len(engines)

    served = before[0]
    for sync in range(2):  # the second reuses the routes' groups and store keys
        _update(actor, tokenizer, prompt_ids, served)
        sync_weights(weight_sync, dtype="float32", version=sync + 1)
        ray.get(actor.call("save_pretrained", str(tmp_path / f"updated-{sync}")))
        expected = _hf_greedy(tmp_path / f"updated-{sync}", prompt_ids)
        assert expected != served, "the update should change the greedy output (else this test proves nothing)"
        expected_log_probs = _hf_log_probs(tmp_path / f"updated-{sync}", prompt_ids, expected)
        for engine in engines:
            after, log_probs = _vllm_greedy(engine, prompt_ids)
            assert after == expected
            # Equal greedy tokens can hide a partly stale model (e.g. old output embeddings, or a
            # prompt's cached KV): the log-probs must agree too.
            for engine_log_probs, hf_log_probs in zip(log_probs, expected_log_probs):
                torch.testing.assert_close(engine_log_probs, hf_log_probs, rtol=0, atol=1e-4)
        served = expected
    for worker in actor.workers + engines:  # the other placement's case needs the memory
        ray.kill(worker)
    remove_placement_group(group)


def test_a_partial_rollout_takes_the_new_weights_mid_sample_and_loses_no_token(tiny_model, local_ray, tmp_path):
    """rollout.partial: a sync sent while the engine samples pauses it where it stands. Each sample keeps
    the tokens it had and goes on with the new weights from there: every token is the greedy choice of the
    policy its version names, on the sample's own prefix, with that policy's log-prob (Hugging Face's of
    the initial and of the updated actor). A token lost or repeated at the pause would put every later one
    on another prefix than the sample's."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = [_chat_ids(tokenizer, p) for p in PROMPTS[:3]]
    placement = Placement(use_gpu=False, bundles=2, ranks={"actor": [0], "rollout": [1]}, engine_width=1)
    group = create_placement_group(placement)
    actor = ModelGroup("actor", group, placement)
    training = TrainingSpec(bf16=False, learning_rate=0.05, lr_warmup_ratio=0, lr_scheduler="constant",
                            train_batch_size=4, micro_train_batch_size=2, micro_rollout_batch_size=4)
    [engine] = create_rollout_engines(group, placement, str(tiny_model), rollout=RolloutSpec(), dtype="float32",
                                      max_model_len=256, seed=0)
    ray.get(actor.setup(ModelConfig(role="actor", path=str(tiny_model), model=ModelSpec(path=str(tiny_model),
                                    dtype="float32"), training=training, optimizer_steps=1)))
    weight_sync = setup_weight_sync(actor, [engine], placement, bucket_bytes=BUCKET_BYTES)
    _update(actor, tokenizer, prompt_ids + prompt_ids[:1], _hf_greedy(tiny_model, prompt_ids + prompt_ids[:1]))
    ray.get(actor.call("save_pretrained", str(tmp_path / "updated")))  # the engine still has the initial weights

    long = {"n": 1, "temperature": 0.0, "max_tokens": 192, "ignore_eos": True}
    rollout = engine.generate.remote(prompt_ids, long)
    wait_for(lambda: (tokens := ray.get(engine.in_flight_tokens.remote())) and min(tokens) > 0, 120,
             "every sample's first token", interval=0.01, max_interval=0.05)
    sync_weights(weight_sync, dtype="float32", version=1, partial=True)
    completions, _ = ray.get(rollout)

    models = {version: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
              for version, path in ((0, tiny_model), (1, tmp_path / "updated"))}
    for ids, [sample] in zip(prompt_ids, completions):
        assert len(sample.token_ids) == len(sample.log_probs) == len(sample.versions) == long["max_tokens"]
        paused_at = sample.versions.index(1)
        assert 0 < paused_at and sample.versions == [0] * paused_at + [1] * (len(sample.versions) - paused_at)
        sequence = torch.tensor([ids + sample.token_ids])
        for version, model in models.items():
            with torch.no_grad():
                log_probs = torch.log_softmax(model(sequence).logits[0, len(ids) - 1:-1], -1)
            rows = [i for i, v in enumerate(sample.versions) if v == version]
            chosen = log_probs[rows].gather(1, torch.tensor(sample.token_ids)[rows, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.log_probs)[rows], chosen, rtol=0, atol=1e-4)
            assert (chosen >= log_probs[rows].max(-1).values - 1e-4).all(), f"version {version}: not its greedy token"
    for worker in actor.workers + [engine]:
        ray.kill(worker)
    remove_placement_group(group)
