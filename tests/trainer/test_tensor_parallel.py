"""training.tensorParallel: the tiny actor trained through DeepSpeed's AutoTP over 2 gloo ranks equals the same
actor on 1 rank: the log-probs of every token of packed rows of unequal lengths, the loss and the gathered gradients
of the first step, the weights after 3 steps and the gathered weights the weight sync sends.

One pair of processes (this file run as a script) computes both: rank 0 first trains the single-rank run in a world
of its own, then both ranks train the split one; the test compares what rank 0 saved. float32 throughout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

STEPS, TRAIN_BATCH, MICRO = 3, 4, 2
LEARNING_RATE = 1e-3
# The split sums each row-parallel matmul (o_proj, down_proj) in two halves and all-reduces them: float32
# additions in another order than one matmul's. Measured (2026-11-28): log-probs within 1.8e-7 relative, the loss
# 6e-8, the gradient norms 1.9e-6, the gradients 1.1e-8 absolute (1.4e-6 of each tensor's norm): within RTOL.
RTOL = 1e-5
# The weights after 3 AdamW steps differ by up to 7.4e-6 absolute (2.3e-6 of a tensor's norm, but 1.8e-4 of
# k_proj.bias's): AdamW moves every element by about the learning rate whatever its gradient's size, so an element
# whose gradient is at rounding level moves by an amount the rounding decides. k_proj.bias is all such elements:
# softmax over the keys does not change when every key score shifts by q.b, so its gradient is zero in exact
# arithmetic and either run moves it by noise. The weights are compared to 1% of one step's largest move.
WEIGHT_ATOL = LEARNING_RATE / 100


def _experience(vocab: int):
    """STEPS x TRAIN_BATCH samples of unequal lengths, packed by the passes: left-padded prompts of 2-6 tokens,
    right-padded responses of 1-5 (the shortest sample 3 tokens: the ranks of a split read whole rows)."""
    from rlhf_trainer.experience import Experience

    generator = torch.Generator().manual_seed(0)
    rows, prompt, actions = STEPS * TRAIN_BATCH, 6, 5
    sequences = torch.randint(3, vocab, (rows, prompt + actions), generator=generator)
    attention_mask = torch.ones_like(sequences)
    action_mask = torch.ones(rows, actions, dtype=torch.bool)
    for row in range(rows):
        attention_mask[row, : row % 5] = 0  # prompts of 6 down to 2 tokens
        ended = actions - row % actions  # responses of 5 down to 1 token, right-padded
        action_mask[row, ended:] = False
        attention_mask[row, prompt + ended:] = 0
    return Experience(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                      action_log_probs=torch.full((rows, actions), -3.0),
                      advantages=torch.randn(rows, actions, generator=generator),
                      values=torch.randn(rows, actions, generator=generator) / 10,
                      returns=torch.randn(rows, actions, generator=generator))


def _model(role: str, model_path: str, ranks: int, split: int, zero_stage: int):
    from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
    from rlhf_trainer.workers.engine import ModelConfig, load_model

    training = TrainingSpec(zero_stage=zero_stage, bf16=False, learning_rate=LEARNING_RATE,
                            critic_learning_rate=LEARNING_RATE, lr_warmup_ratio=0, lr_scheduler="constant",
                            train_batch_size=TRAIN_BATCH, micro_train_batch_size=MICRO, micro_rollout_batch_size=MICRO,
                            loss_aggregation="token-mean", tensor_parallel={"size": split})
    cfg = ModelConfig(role=role, path=model_path, model=ModelSpec(path=model_path, dtype="float32"),
                      training=training, optimizer_steps=STEPS + 1, algorithm="ppo")
    torch.manual_seed(training.seed)  # as ModelWorker.setup seeds it: the critic's new score head
    return load_model(cfg, torch.distributed.get_rank(), ranks)


def _steps(experience, ranks: int, split: int) -> list[list]:
    """This rank's micro-batches of each optimizer step, as the group deals them (the ranks of a split the same)."""
    from rlhf_trainer.workers.group import micro_batches_per_rank
    from rlhf_trainer.workers.tensor_parallel import same_rows

    per_rank = same_rows(micro_batches_per_rank(experience, ranks // split, train_batch_size=TRAIN_BATCH,
                                                micro_batch_size=MICRO, epochs=1,
                                                generator=torch.Generator().manual_seed(0)), split)
    own = per_rank[torch.distributed.get_rank()]
    per_step = len(own) // STEPS
    return [own[index * per_step:(index + 1) * per_step] for index in range(STEPS)]


def _full_gradients(model, split: int, into: dict):
    """An optimizer pre-step hook keeping the first step's gradients, the shards gathered along AutoTP's dimension."""
    import deepspeed

    from rlhf_trainer.workers.tensor_parallel import is_sharded

    def keep(optimizer, args, kwargs):
        if into:
            return
        for name, param in model.engine.module.named_parameters():
            grad = param.grad
            if is_sharded(param):
                dim = param.ds_autotp_universal_checkpoint_meta["partition_dim"]
                parts = [torch.empty_like(grad) for _ in range(split)]
                torch.distributed.all_gather(parts, grad.contiguous(),
                                             group=deepspeed.utils.groups.get_tensor_model_parallel_group())
                grad = torch.cat(parts, dim)
            into[name] = grad.clone()

    return keep


def _run(model_path: str, ranks: int, split: int, checkpoints: str | None = None) -> dict:
    """On this rank of a world of `ranks` split over `split`: the actor (ZeRO-0) read, trained STEPS steps and read
    again; with `checkpoints`, saved, moved a step further and loaded back; the critic (ZeRO-2) the same."""
    from rlhf_trainer.workers import weights
    from rlhf_trainer.workers.model_worker import ModelWorker
    from rlhf_trainer.workers.objectives import mean_over_micro_batches, policy_step, value_step

    full = lambda model: {name: t.clone() for name, t in weights.named_full_parameters(model)}  # noqa: E731
    actor = _model("actor", model_path, ranks, split, zero_stage=0)
    experience = _experience(len(actor.tokenizer))
    with torch.no_grad(), actor.scoring():
        log_probs = actor.action_log_probs(experience.sequences, experience.attention_mask, experience.num_actions)
    grads = {}
    actor.engine.optimizer.register_step_pre_hook(_full_gradients(actor, split, grads))
    steps = _steps(experience, ranks, split)
    metrics = [mean_over_micro_batches(actor, policy_step, step) for step in steps]
    results = {
        "log_probs": log_probs, "loss": [m["policy_loss"] for m in metrics], "grad_norms": list(actor.grad_norms),
        "grads": grads, "weights": full(actor), "shapes": weights.full_shapes(actor),
        "sent": [torch.cat([t.reshape(-1) for _, t in bucket]) for bucket in
                 weights.merged_buckets(actor, torch.float32, bucket_bytes=64 << 10)],
        "shard_rows": [tuple(p.shape) for name, p in actor.engine.module.named_parameters() if "q_proj.weight" in name],
    }
    if checkpoints:
        worker = ModelWorker(torch.distributed.get_rank(), ranks)
        worker.model = actor
        worker.save_checkpoint(checkpoints, "saved")
        mean_over_micro_batches(actor, policy_step, steps[0])
        results["moved"] = full(actor)
        worker.load_checkpoint(checkpoints, "saved")
        results["restored"] = full(actor)

    critic = _model("critic", model_path, ranks, split, zero_stage=2)
    with torch.no_grad(), critic.scoring():
        results["values"] = critic.action_values(experience.sequences, experience.attention_mask,
                                                 experience.num_actions)
    critic_metrics = [mean_over_micro_batches(critic, value_step, step)
                      for step in _steps(experience, ranks, split)]
    results |= {"value_loss": [m["value_loss"] for m in critic_metrics], "critic_weights": full(critic),
                "critic_grad_norms": list(critic.grad_norms)}
    return results


def _world(rank: int, ranks: int, port: int) -> None:
    from rlhf_trainer.workers.distributed import init_distributed

    # Rank 1 waits here while rank 0 trains the single-rank run.
    store = torch.distributed.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=timedelta(minutes=3))
    init_distributed(rank, ranks, store, use_gpu=False)


def _rank_main(rank: int, model_path: str, ports: list[int], out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    if rank == 0:  # the single-rank run, in a world of its own, before the pair's
        _world(0, 1, ports[0])
        results["single"] = _run(model_path, 1, 1)
        torch.distributed.destroy_process_group()
    _world(rank, 2, ports[1])
    results["split"] = _run(model_path, 2, 2, checkpoints=str(Path(out).parent / "checkpoints"))
    if rank == 0:
        torch.save(results, out)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "runs.pt"
    ports = [str(_free_port()), str(_free_port())]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "operator"), str(root / "trainer_image"), str(root)]),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), str(tiny_model), *ports, str(out)], env=env)
             for rank in (0, 1)]
    codes = [proc.wait(timeout=240) for proc in procs]
    assert codes == [0, 0], f"the ranks exited {codes}"
    return torch.load(out)


def test_autotp_of_width_2_trains_as_one_rank(runs):
    single, split = runs["single"], runs["split"]
    assert split["shard_rows"][0][0] * 2 == single["shard_rows"][0][0], "AutoTP did not split q_proj"

    torch.testing.assert_close(split["log_probs"], single["log_probs"], rtol=RTOL, atol=1e-6)
    assert split["loss"][0] == pytest.approx(single["loss"][0], rel=RTOL)
    assert split["grad_norms"] == pytest.approx(single["grad_norms"], rel=RTOL)
    assert split["grads"].keys() == single["grads"].keys()
    for name, grad in single["grads"].items():
        torch.testing.assert_close(split["grads"][name], grad, rtol=RTOL, atol=1e-7, msg=name)
    assert split["loss"] == pytest.approx(single["loss"], rel=RTOL)
    for name, weight in single["weights"].items():
        torch.testing.assert_close(split["weights"][name], weight, rtol=RTOL, atol=WEIGHT_ATOL, msg=name)
    assert split["shapes"] == single["shapes"]  # what the weight sync announces
    assert len(split["sent"]) == len(single["sent"])
    for bucket, expected in zip(split["sent"], single["sent"]):
        torch.testing.assert_close(bucket, expected, rtol=RTOL, atol=WEIGHT_ATOL)

    # the critic, split under ZeRO-2 (DeepSpeed's own gradient norm and clipping over the split)
    torch.testing.assert_close(split["values"], single["values"], rtol=RTOL, atol=1e-6)
    assert split["value_loss"] == pytest.approx(single["value_loss"], rel=RTOL)
    assert split["critic_grad_norms"] == pytest.approx(single["critic_grad_norms"], rel=RTOL)
    for name, weight in single["critic_weights"].items():  # 2 of the embedding's 46848 elements moved apart, by
        apart = (split["critic_weights"][name] - weight).abs()  # 7.8e-4 at most: rounding-level gradients, as above
        assert apart.max() < LEARNING_RATE and (apart > WEIGHT_ATOL).sum() <= weight.numel() // 10_000, name

    # DeepSpeed's checkpoint of the split (each rank's shard) loads back into it
    assert any(not torch.equal(split["moved"][name], weight) for name, weight in split["weights"].items())
    for name, weight in split["weights"].items():
        assert torch.equal(split["restored"][name], weight), name


@pytest.mark.parametrize("changes, path, fix", [
    ({"training.zeroStage": 3}, "spec.training.zeroStage", "set zeroStage 2"),
    ({"models.actor.lora": {"rank": 8}}, "spec.models.actor.lora", "dropping the LoRA adapters"),
    ({"resources.gpus": {"actor": 3}}, "spec.resources.gpus.actor", "make resources.gpus.actor a multiple of it"),
    ({"resources.gpus": {}}, "spec.resources.gpus.actor", "set resources.gpus.actor to a multiple"),
], ids=["zero-3", "lora", "ranks", "cpu-ranks"])
def test_admission_refuses_what_autotp_cannot_split_with_the_fix(changes, path, fix):
    """The CEL rules the API server and `rlhf validate` apply, on the tiny CPU example with a split of 2 over 2
    ranks under ZeRO-2 (valid) and one change."""
    import yaml

    from rlhf_api.validation import InvalidJob, validate

    root = Path(__file__).resolve().parents[2]
    manifest = yaml.safe_load((root / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    spec = manifest["spec"]
    base = {"training.tensorParallel": {"size": 2}, "training.zeroStage": 2, "resources.gpus": {"actor": 2}}
    for settings in (base, changes):
        for dotted, value in settings.items():
            *parents, key = dotted.split(".")
            node = spec
            for parent in parents:
                node = node.setdefault(parent, {})
            node[key] = value
        if settings is base:
            validate(manifest)
    with pytest.raises(InvalidJob) as refused:
        validate(manifest)
    assert any(error.path == path and fix in error.message for error in refused.value.errors), refused.value.errors


def test_the_trainer_refuses_a_split_the_model_s_key_value_heads_do_not_divide(toy_job, tmp_path):
    """The tiny model has 4 attention heads and 2 key-value heads: 2 ranks split it, 4 do not (checks.py, before
    Ray or any model starts)."""
    import yaml

    from rlhf_api.validation import InvalidJob, validate
    from rlhf_trainer.checks import check

    def spec(size: int):
        job = toy_job(**{"training.tensorParallel": {"size": size}, "training.zeroStage": 2,
                         "resources.gpus": {"actor": size}})
        return validate(yaml.safe_load(job.read_text())).spec

    assert check(spec(2), tmp_path).ranks["actor"] == [0, 1]
    with pytest.raises(InvalidJob) as refused:
        check(spec(4), tmp_path)
    assert [(e.path, e.message) for e in refused.value.errors] == [(
        "spec.training.tensorParallel.size", "the actor's model has 2 key-value heads, which AutoTP cannot split over "
        "4 ranks: use a size that divides 2")]


def test_a_group_deals_each_data_parallel_rank_s_rows_to_every_rank_of_its_split():
    """ModelGroup's row ranges and outputs for 4 ranks split 2 ways: 2 data-parallel ranks (no Ray: the dealing
    alone)."""
    from rlhf_trainer.workers.group import ModelGroup

    group = ModelGroup.__new__(ModelGroup)
    group.workers, group.split = [None] * 4, 2
    shards, pad = group._shards(5)  # 5 rows: 3 per data-parallel rank, one of padding
    assert shards == [slice(0, 3), slice(0, 3), slice(3, 6), slice(3, 6)] and pad == 1


if __name__ == "__main__":  # one rank of the pair: rank, model, port of the single run, port of the pair, output
    _rank_main(int(sys.argv[1]), sys.argv[2], [int(p) for p in sys.argv[3:5]], sys.argv[5])
