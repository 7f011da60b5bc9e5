"""The glue between a model group and the model: a real ModelWorker group's log-probs (actor, at
the sampling temperature) and values (critic) equal what plain transformers gives for each prefix
on its own, unpadded.

The batch is laid out as the trainer packs rollouts: prompts of different lengths left-padded,
responses of different lengths right-padded. The reference runs every prefix alone, without
padding, so it needs no attention mask or position ids: any slip of the group's padding, position
ids, temperature, the shift between logits and the tokens they predict, or of where the critic is
read (V(s_t) is the value of the prefix before response token t) shows.

Two model families: the tiny Qwen2 of the example job, and a tiny GPT-2. Qwen2's rotary positions
are relative, so left padding shifts every position of a row alike and leaves its outputs unchanged
with or without position ids; GPT-2's learned absolute positions are what make a wrong position id
visible (about 0.6 in the logits of this GPT-2 when the padding is counted).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import remove_placement_group
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config

from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
from rlhf_trainer.tiny import build_tokenizer
from rlhf_trainer.workers.engine import ModelConfig
from rlhf_trainer.workers.group import ModelGroup, create_placement_group

pytestmark = pytest.mark.timeout(300)

TEMPERATURE = 0.7
# (prompt length, response length) of each row; 5 rows over 2 ranks also exercise the group's row padding
ROWS = [(6, 4), (2, 3), (4, 1), (1, 4), (5, 2)]
FIRST_TOKEN = 3  # after the special tokens (pad, turn, eos): no sampled token is padding


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sequences and attention_mask [B, P + T] (prompts left-padded, responses right-padded, pad 0),
    action_mask [B, T]."""
    generator = torch.Generator().manual_seed(0)
    width, num_actions = max(p for p, _ in ROWS), max(t for _, t in ROWS)
    sequences = torch.zeros(len(ROWS), width + num_actions, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    for row, (prompt, response) in enumerate(ROWS):
        real = slice(width - prompt, width + response)
        sequences[row, real] = torch.randint(FIRST_TOKEN, vocab, (prompt + response,), generator=generator)
        attention_mask[row, real] = 1
    return sequences, attention_mask, attention_mask[:, width:].bool()


def _per_prefix(read, sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int) -> torch.Tensor:
    """[B, T]: read(prefix [1, L], token) for each valid response token, the prefix being the row's
    real tokens before it (no padding); NaN on padding."""
    out = torch.full((sequences.shape[0], num_actions), float("nan"))
    width = sequences.shape[1] - num_actions
    with torch.no_grad():
        for row in range(sequences.shape[0]):
            real = attention_mask[row].bool()
            for t in range(num_actions):
                position = width + t
                if real[position]:
                    prefix = sequences[row, :position][real[:position]]
                    out[row, t] = read(prefix.unsqueeze(0), sequences[row, position])
    return out


def _log_prob(model):
    """log softmax(logits / T) of the next token after the prefix: the sampling distribution's."""
    return lambda prefix, token: torch.log_softmax(model(prefix).logits[0, -1] / TEMPERATURE, -1)[token]


def _value(model):
    """The classifier's score of the prefix on its own (it reads the last token: no padding here)."""
    return lambda prefix, token: model(prefix).logits[0, 0]


def _tiny_gpt2(directory: Path, kind: str) -> Path:
    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=64, n_layer=2, n_head=2, num_labels=1,
                        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = (AutoModelForCausalLM if kind == "causal-lm" else AutoModelForSequenceClassification).from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def gpt2_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt2")
    return {kind: _tiny_gpt2(root / kind, kind) for kind in ("causal-lm", "reward")}


@pytest.fixture
def start_group(local_ray):
    """start_group(role, path, ranks, **ModelConfig fields) -> a set-up ModelGroup (ZeRO-3, float32);
    its workers and placement group go at teardown."""
    started = []

    def start(role: str, path: Path, ranks: int, **config) -> ModelGroup:
        placement = Placement(use_gpu=False, bundles=ranks, ranks={role: list(range(ranks))})
        bundles = create_placement_group(placement)
        group = ModelGroup(role, bundles, placement)
        started.append((group, bundles))
        training = TrainingSpec(zero_stage=3, bf16=False, micro_rollout_batch_size=2)
        ray.get(group.setup(ModelConfig(role=role, path=str(path), model=ModelSpec(path=str(path), dtype="float32"),
                                        training=training, **config)))
        return group

    yield start
    for group, bundles in started:
        for worker in group.workers:
            ray.kill(worker)
        remove_placement_group(bundles)


# role -> (tiny model kind, the transformers class of the reference, its reading of a prefix, config)
ROLES = {
    "actor": ("causal-lm", AutoModelForCausalLM, _log_prob, {"temperature": TEMPERATURE}),
    "critic": ("reward", AutoModelForSequenceClassification, _value, {}),
}


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
@pytest.mark.parametrize("role", ROLES)
def test_group_forward_equals_transformers_on_each_unpadded_prefix(
        role, family, start_group, tiny_model, tiny_reward_model, gpt2_models):
    kind, auto_class, reader, config = ROLES[role]
    path = gpt2_models[kind] if family == "gpt2" else {"causal-lm": tiny_model, "reward": tiny_reward_model}[kind]
    model = auto_class.from_pretrained(path, dtype=torch.float32).eval()
    sequences, attention_mask, action_mask = _batch(model.config.vocab_size)
    num_actions = action_mask.shape[1]
    expected = _per_prefix(reader(model), sequences, attention_mask, num_actions)
    assert not expected[action_mask].isnan().any()

    group = start_group(role, path, 2, **config)
    got = group.forward(sequences, attention_mask, num_actions)

    assert got.shape == action_mask.shape
    torch.testing.assert_close(got[action_mask], expected[action_mask], rtol=1e-4, atol=1e-4)
