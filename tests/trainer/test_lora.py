"""LoRA (models.<role>.lora) trains only the adapters, serves vLLM the merged weights, shares the
actor's base weights as the reference, and exports an adapter peft loads (and, asked, the merged
model): on a 2-rank ZeRO-3 actor with a vLLM engine over gloo, and through `rlhf run` in grpo and dpo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch
import yaml
from peft import PeftModel
from ray.util.placement_group import remove_placement_group
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_api.planning.placement import Placement, plan_placement
from rlhf_api.v1alpha1 import LoRASpec, ModelSpec, RLHFJob, RolloutSpec, TrainingSpec
from rlhf_trainer.experience import Experience
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import run
from rlhf_trainer.workers.engine import ModelConfig
from rlhf_trainer.workers.group import ModelGroup, create_placement_group, create_rollout_engines
from rlhf_trainer.workers.weight_sync import setup_weight_sync, sync_weights

from test_offline import _dataset, _pair_records, _response_logps, _write_job
from test_weight_sync import BUCKET_BYTES, GREEDY, PROMPTS, _chat_ids, _hf_log_probs, _update, _vllm_greedy

pytestmark = pytest.mark.timeout(900)

LORA = {"rank": 8, "alpha": 16, "exportMerged": True}


def _base_unchanged_and_merged_is_base_plus_adapter(base_dir: Path, final: Path) -> None:
    """The merged export equals base + scale * B @ A of the exported adapter on every adapted layer,
    and the base exactly elsewhere: the training changed the adapters only."""
    base = load_file(base_dir / "model.safetensors")
    merged = load_file(final / "merged" / "model.safetensors")
    adapter = load_file(final / "adapter_model.safetensors")
    config = json.loads((final / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    assert merged.keys() == base.keys()
    adapted = 0
    for name, weight in base.items():
        a_key = "base_model.model." + name.removesuffix(".weight") + ".lora_A.weight"
        if a_key in adapter:
            delta = scale * adapter[a_key.replace("lora_A", "lora_B")] @ adapter[a_key]
            assert delta.abs().max() > 0, f"{name}: the adapter did not train"
            torch.testing.assert_close(merged[name], weight + delta, rtol=0, atol=1e-6)
            adapted += 1
        else:
            assert torch.equal(merged[name], weight), f"{name} is not adapted but changed"
    assert adapted == 14  # all-linear: 7 projections in each of the tiny model's 2 layers, not the head


@torch.no_grad()
def _peft_log_probs(base_dir: Path, adapter_dir: Path, merged_dir: Path, ids: torch.Tensor) -> None:
    """The exported adapter, loaded with peft onto the base, gives the merged export's log-probs."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, adapter_dir)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    torch.testing.assert_close(with_adapter(ids).logits, merged(ids).logits, rtol=0, atol=1e-5)


def test_lora_actor_trains_adapters_only_and_vllm_serves_the_merged_weights(tiny_model, local_ray, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    prompt_ids = [_chat_ids(tokenizer, p) for p in PROMPTS]
    placement = Placement(use_gpu=False, bundles=3, ranks={"actor": [0, 1], "rollout": [2]})
    group = create_placement_group(placement)
    actor = ModelGroup("actor", group, placement)
    training = TrainingSpec(zero_stage=3, bf16=False, learning_rate=0.05, lr_warmup_ratio=0, lr_scheduler="constant",
                            train_batch_size=4, micro_train_batch_size=2, micro_rollout_batch_size=4)
    lora = LoRASpec(rank=8, alpha=16, export_merged=True)
    model = ModelSpec(path=str(tiny_model), dtype="float32", lora=lora)
    engines = create_rollout_engines(group, placement, str(tiny_model), rollout=RolloutSpec(), dtype="float32",
                                     max_model_len=256, seed=0)
    ray.get(actor.setup(ModelConfig(role="actor", path=str(tiny_model), model=model, training=training,
                                    optimizer_steps=2)))
    weight_sync = setup_weight_sync(actor, engines, placement, bucket_bytes=BUCKET_BYTES)
    before, _ = _vllm_greedy(engines[0], prompt_ids)
    rows = [ids + out for ids, out in zip(prompt_ids, before)]
    width = max(map(len, rows))
    sequences = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    attention_mask = (sequences != tokenizer.pad_token_id).long()
    reference = actor.base_model_view("reference")
    reference_before = reference.forward(sequences, attention_mask, GREEDY["max_tokens"])
    weights_before = ray.get(actor.call("checksums"))[0]

    _update(actor, tokenizer, prompt_ids, before)
    _update(actor, tokenizer, prompt_ids, before)  # lora_A gets a gradient once lora_B is nonzero
    sync_weights(weight_sync, dtype="float32", version=1)
    weights_after = ray.get(actor.call("checksums"))[0]
    changed = {name for name in weights_before if weights_before[name] != weights_after[name]}
    assert changed == {name for name in weights_before if ".lora_" in name}, "only (and every) adapter trains"

    final = tmp_path / "final"
    ray.get(actor.call("save_pretrained", str(final)))
    _base_unchanged_and_merged_is_base_plus_adapter(tiny_model, final)
    merged = final / "merged"
    expected, _ = _vllm_greedy(engines[0], prompt_ids)
    assert expected != before, "the update should change the greedy output (else this test proves nothing)"
    # vLLM serves the merged weights: its log-probs are those of the merged model under Hugging Face.
    for engine_log_probs, hf_log_probs in zip(_vllm_greedy(engines[0], prompt_ids)[1],
                                              _hf_log_probs(merged, prompt_ids, expected)):
        torch.testing.assert_close(engine_log_probs, hf_log_probs, rtol=0, atol=1e-4)
    _peft_log_probs(tiny_model, final, merged, torch.tensor([rows[0]]))

    # The reference is the untouched base: adapters off, the same log-probs as before the updates,
    # and those of the base model under Hugging Face.
    reference_after = reference.forward(sequences, attention_mask, GREEDY["max_tokens"])
    torch.testing.assert_close(reference_after, reference_before, rtol=0, atol=1e-5)
    base_log_probs = _hf_log_probs(tiny_model, prompt_ids, before)
    for row, hf_log_probs in zip(reference_after, base_log_probs):
        torch.testing.assert_close(row[-len(hf_log_probs):], hf_log_probs, rtol=0, atol=1e-4)
    assert not torch.allclose(actor.forward(sequences, attention_mask, GREEDY["max_tokens"]), reference_after)
    _release(group, actor.workers + engines)


def _release(group, handles: list) -> None:
    """Free the module's Ray instance for the next test."""
    for handle in handles:
        ray.kill(handle)
    remove_placement_group(group)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_with_lora_shares_the_actor_as_reference(toy_job, tiny_model, local_ray, tmp_path):
    job = toy_job(**{"models.actor.lora": LORA, "training.maxSteps": 2, "training.learningRate": 0.02,
                     "checkpoint.intervalSteps": 0})
    spec = RLHFJob.model_validate(yaml.safe_load(job.read_text())).spec
    placement = plan_placement(spec, use_gpu=False)
    assert placement.shared == {"reference": "actor"} and "reference" not in placement.ranks

    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    metrics = _metrics(out)
    assert len(metrics) == 2
    # Step 1 scores the rollouts with the untrained adapter (B = 0): the policy is the reference.
    # After one update the reference (adapters off) no longer equals the policy.
    assert abs(metrics[0]["kl"]) < 1e-6 and metrics[1]["kl"] > 1e-6, metrics
    final = out / "checkpoints" / "final"
    _base_unchanged_and_merged_is_base_plus_adapter(tiny_model, final)
    step = next((out / "checkpoints").glob("step-*"))
    # The checkpoint holds the adapters, not a second copy of the frozen base (DeepSpeed keeps the
    # output head tied to the embedding under its own name).
    saved = torch.load(next(step.rglob("mp_rank_00_model_states.pt")), weights_only=False)["module"]
    assert any(".lora_" in name for name in saved)
    assert {name for name in saved if ".lora_" not in name} <= {"lm_head.weight"}, sorted(saved)

    # Resumed, the run continues with the checkpoint's adapters: without them the policy would be
    # the base again, and step 3's KL 0 as step 1's was.
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["training"]["maxSteps"] = 3
    job.write_text(yaml.safe_dump(manifest))
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "resumed.jsonl")]) == 0
    resumed = [json.loads(line) for line in (out / "resumed.jsonl").read_text().splitlines()]
    assert [m["step"] for m in resumed] == [3] and resumed[0]["kl"] > 1e-6, resumed


def test_dpo_with_lora_trains_the_adapters_against_the_base(tiny_model, local_ray, tmp_path):
    records = _pair_records(32)
    job = _write_job(tmp_path, tiny_model, "dpo", "preferences", records, learningRate=5.0e-3, epochs=2, maxSteps=4,
                     preference={"beta": 0.5})
    manifest = yaml.safe_load(job.read_text())
    manifest["spec"]["models"]["actor"]["lora"] = LORA
    job.write_text(yaml.safe_dump(manifest))
    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    metrics = _metrics(out)
    # Before the first update the policy is its reference (the base, adapters off): h = 0, loss = log 2.
    assert metrics[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    final = out / "checkpoints" / "final"
    _base_unchanged_and_merged_is_base_plus_adapter(tiny_model, final)
    # The merged policy prefers the chosen responses it trained on more than the base does.
    dataset, pad = _dataset(tiny_model, records, ("chosen", "rejected"), tmp_path)
    implicit = _response_logps(final / "merged", dataset, pad)[0] - _response_logps(tiny_model, dataset, pad)[0]
    assert (implicit[:, 0] - implicit[:, 1]).mean() > 0
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_model)("Repeat the letter c.")["input_ids"]])
    _peft_log_probs(tiny_model, final, final / "merged", ids)


def test_lora_critic_trains_adapters_and_its_value_head_only(tiny_model, local_ray):
    """A LoRA critic (peft's sequence-classification task): the adapters and the fresh value head
    train, the base stays as it was."""
    placement = Placement(use_gpu=False, bundles=1, ranks={"critic": [0]})
    group = create_placement_group(placement)
    critic = ModelGroup("critic", group, placement)
    # value_clip 100: the plain squared error, so that every step has gradients (lora_A gets its first in step 2).
    training = TrainingSpec(zero_stage=2, bf16=False, critic_learning_rate=0.005, lr_warmup_ratio=0, value_clip=100,
                            lr_scheduler="constant", train_batch_size=4, micro_train_batch_size=2)
    model = ModelSpec(path=str(tiny_model), dtype="float32", lora=LoRASpec(rank=4, alpha=8))
    ray.get(critic.setup(ModelConfig(role="critic", path=str(tiny_model), model=model, training=training)))
    sequences = torch.randint(1, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(sequences)
    values = critic.forward(sequences, attention_mask, 4)
    before = ray.get(critic.call("checksums"))[0]
    experience = Experience(sequences=sequences, attention_mask=attention_mask,
                            action_mask=torch.ones(4, 4, dtype=torch.bool), action_log_probs=torch.zeros(4, 4),
                            values=values, returns=values + 1.0)
    for _ in range(2):
        ray.get(critic.train(experience, train_batch_size=4, micro_batch_size=2, epochs=1,
                             generator=torch.Generator().manual_seed(0)))
    after = ray.get(critic.call("checksums"))[0]
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {name for name in before if ".lora_" in name or ".modules_to_save." in name}
    error = {name: (v - experience.returns).square().mean() for name, v in
             {"before": values, "after": critic.forward(sequences, attention_mask, 4)}.items()}
    assert error["after"] < error["before"], error
    _release(group, critic.workers)


def test_merged_entries_of_a_conv1d_model_announce_the_shape_they_send():
    """GPT-2's layers are Conv1D, their weights stored [in, out] (peft's fan_in_fan_out): the shape
    announced to vLLM before each weight is the merged tensor's, which is the base model's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from rlhf_trainer.workers.lora import apply_lora, merged_entries

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, n_inner=48)
    model = GPT2LMHeadModel(config)
    base = {name: tuple(p.shape) for name, p in model.named_parameters()}
    apply_lora(model, LoRASpec(rank=4, alpha=8, target_modules=["c_attn", "c_fc"]), "actor")
    entries = merged_entries(model)
    assert sum(len(params) == 3 for _, _, params, _ in entries) == 2  # the two adapted layers
    for name, shape, _, compute in entries:
        assert shape == tuple(compute().shape) == base[name], name
