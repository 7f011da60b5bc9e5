"""Sample packing (training.packSamples): the packed forward gives the padded forward's log-probs and
gradients, for every attention implementation transformers runs on CPU, on a batch of mixed lengths
laid out as the trainer lays it out (left-padded prompts, right-padded responses). flash_attention_2
needs a GPU: its layout (one row) is run here under sdpa and eager, checked with transformers' own
test for whether flash-attention reads a batch as packed samples, and run through flash-attention's
dispatch with its kernels written in sdpa."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
from transformers.masking_utils import flash_attention_mask
from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
from rlhf_trainer.losses import masked_sum, token_log_probs
from rlhf_trainer.workers.engine import Model, ModelConfig
from rlhf_trainer.workers.packing import pack

PAD, ACTIONS = 0, 6
# (prompt length, response length): rows of very different lengths, one response of a single token.
SHAPES = [(3, 6), (12, 2), (5, 6), (20, 1), (7, 4), (2, 6)]


def mixed_batch(vocab: int, shapes=SHAPES, actions: int = ACTIONS, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """sequences, attention_mask and action_mask of prompts left-padded to the longest and responses
    right-padded to `actions`."""
    generator = torch.Generator().manual_seed(seed)
    prompt_width = max(p for p, _ in shapes)
    sequences = torch.full((len(shapes), prompt_width + actions), PAD)
    attention_mask = torch.zeros_like(sequences)
    for row, (prompt, response) in enumerate(shapes):
        start, end = prompt_width - prompt, prompt_width + response
        sequences[row, start:end] = torch.randint(1, vocab, (end - start,), generator=generator)
        attention_mask[row, start:end] = 1
    return sequences, attention_mask, attention_mask[:, -actions:].bool()


def _model(model_dir, attn: str, packed: bool, spec_attn: str | None = None) -> Model:
    """The trainer's Model with a plain transformers module as its engine (the forward is the same),
    running attention `attn` and packing as for models.actor.attnImplementation `spec_attn`."""
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    spec = ModelSpec(path=str(model_dir), dtype="float32", attn_implementation=spec_attn or attn)
    cfg = ModelConfig(role="actor", path=str(model_dir), model=spec,
                      training=TrainingSpec(pack_samples=packed), temperature=0.7)
    return Model(cfg, 0, module, tokenizer=None, zero3=False)


def _log_probs_and_grads(model: Model, sequences, attention_mask, action_mask):
    log_probs = token_log_probs(model.action_logits(sequences, attention_mask, ACTIONS), sequences[:, -ACTIONS:])
    # A loss that weighs every row and position differently, so a row mixed up with another shows.
    weights = torch.arange(1, log_probs.numel() + 1, dtype=torch.float32).view_as(log_probs)
    masked_sum(log_probs * weights, action_mask).backward()
    grads = {name: p.grad.clone() for name, p in model.engine.named_parameters() if p.grad is not None}
    return log_probs.detach(), grads


def _flash_attention_on_cpu(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            position_ids=None, **kwargs):
    """flash_attention_2 as transformers dispatches it for a padding-free batch (no mask): its own check
    (_is_packed_sequence) decides from the position ids between the varlen kernel, causal attention
    within each segment of cu_seqlens, and the plain kernel, causal attention over each whole row;
    the kernels written with sdpa. query [B, H, S, D] -> [B, S, H, D]."""
    assert attention_mask is None  # what flash_attention_mask gives a batch without padding
    bounds = [0, query.shape[2]]
    if _is_packed_sequence(position_ids, query.shape[0]):
        (cu_seqlens, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
        bounds = cu_seqlens.tolist()
    out = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=True)
        for a, b in zip(bounds, bounds[1:])], dim=2)
    return out.transpose(1, 2), None


@pytest.fixture(scope="module")
def varlen_on_cpu() -> str:
    """The name of _flash_attention_on_cpu as an attention implementation, with flash-attention's mask."""
    AttentionInterface.register("varlen_on_cpu", _flash_attention_on_cpu)
    AttentionMaskInterface.register("varlen_on_cpu", flash_attention_mask)
    return "varlen_on_cpu"


def test_packed_equals_padded_under_flash_attention_s_dispatch(tiny_model, varlen_on_cpu):
    """With attnImplementation flash_attention_2, packed log-probs and gradients equal padded ones when
    attention runs flash-attention's own dispatch (on CPU, its kernels written with sdpa)."""
    padded = _model(tiny_model, "sdpa", packed=False)
    packed = _model(tiny_model, varlen_on_cpu, True, spec_attn="flash_attention_2")
    _assert_packed_equals_padded(padded, packed)


@pytest.mark.parametrize("spec_attn", [None, "flash_attention_2"], ids=["own-layout", "flash-layout"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_log_probs_and_gradients_equal_padded(tiny_model, attn, spec_attn):
    _assert_packed_equals_padded(_model(tiny_model, attn, packed=False), _model(tiny_model, attn, True, spec_attn))


def _assert_packed_equals_padded(padded: Model, packed: Model) -> None:
    sequences, attention_mask, action_mask = mixed_batch(padded.engine.config.vocab_size)
    expected, expected_grads = _log_probs_and_grads(padded, sequences, attention_mask, action_mask)
    got, grads = _log_probs_and_grads(packed, sequences, attention_mask, action_mask)

    torch.testing.assert_close(got[action_mask], expected[action_mask], rtol=0, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    for name, grad in grads.items():  # float32 rounding, relative to each gradient's scale (up to 200 here)
        expected_grad = expected_grads[name]
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-5 * expected_grad.abs().max(), msg=name)


def test_flash_attention_reads_the_packed_batch_as_separate_samples(tiny_model):
    """With attnImplementation flash_attention_2, the batch the model is called with is one that
    flash-attention's own check reads as packed samples, with a boundary at every sample's start
    (run under sdpa: flash-attention needs a GPU, the batch is the same)."""
    model = _model(tiny_model, "sdpa", packed=True, spec_attn="flash_attention_2")
    calls = []
    model.engine.register_forward_pre_hook(lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True)
    sequences, attention_mask, _ = mixed_batch(model.engine.config.vocab_size)
    with torch.no_grad():
        model.action_log_probs(sequences, attention_mask, ACTIONS)
    (call,) = calls
    input_ids, position_ids = call["input_ids"], call["position_ids"]
    assert _is_packed_sequence(position_ids, batch_size=input_ids.shape[0])
    (cu_seqlens, _), (max_length, _) = prepare_fa_kwargs_from_position_ids(position_ids)
    lengths = sorted(cu_seqlens.diff().tolist())
    assert lengths == sorted(attention_mask.sum(-1).tolist()) and max_length == max(lengths)
    assert cu_seqlens[-1] == input_ids.numel() == attention_mask.sum()  # no padding at all


def test_packing_keeps_attention_within_each_sample(tiny_model):
    """Changing one sample's tokens changes no other sample's log-probs in the packed forward (they
    share rows), and the rows are fewer than the samples."""
    model = _model(tiny_model, "sdpa", packed=True)
    sequences, attention_mask, action_mask = mixed_batch(model.engine.config.vocab_size)
    assert pack(sequences, attention_mask, ACTIONS).input_ids.shape[0] < len(SHAPES)
    with torch.no_grad():
        before = model.action_log_probs(sequences, attention_mask, ACTIONS)
        changed = sequences.clone()
        changed[3][attention_mask[3].bool()] = (changed[3][attention_mask[3].bool()] % 300) + 1
        after = model.action_log_probs(changed, attention_mask, ACTIONS)
    others = torch.arange(len(SHAPES)) != 3
    torch.testing.assert_close(after[others], before[others], rtol=0, atol=1e-6)
    assert not torch.allclose(after[3][action_mask[3]], before[3][action_mask[3]])


def test_rows_hold_every_token_once_with_positions_restarting_per_sample():
    sequences, attention_mask, _ = mixed_batch(300)
    packed = pack(sequences, attention_mask, ACTIONS)
    lengths = attention_mask.sum(-1)
    assert packed.input_ids.shape[1] == lengths.max()
    # Each sample's tokens appear once, in order, with positions 0..len-1.
    real = sorted(tuple(sequences[b][attention_mask[b].bool()].tolist()) for b in range(len(SHAPES)))
    found = []
    for ids, positions in zip(packed.input_ids.tolist(), packed.position_ids.tolist()):
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        found += [tuple(ids[a:b]) for a, b in zip(starts, starts[1:]) if any(ids[a:b])]
        assert all(positions[a:b] == list(range(b - a)) for a, b in zip(starts, starts[1:]))
    assert sorted(found) == real
