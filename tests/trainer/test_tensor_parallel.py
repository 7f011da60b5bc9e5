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
                      advantages=torch.randn(rows, actions, generator=generator))


def _run(model_path: str, ranks: int, split: int) -> dict:
    """Load the actor on this rank of a world of `ranks` split over `split`, read it and train it STEPS steps."""
    import deepspeed

    from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
    from rlhf_trainer.workers import weights
    from rlhf_trainer.workers.engine import ModelConfig, load_model
    from rlhf_trainer.workers.group import micro_batches_per_rank
    from rlhf_trainer.workers.objectives import mean_over_micro_batches, policy_step
    from rlhf_trainer.workers.tensor_parallel import is_sharded, same_rows

    training = TrainingSpec(zero_stage=0, bf16=False, learning_rate=LEARNING_RATE, lr_warmup_ratio=0, lr_scheduler="constant",
                            train_batch_size=TRAIN_BATCH, micro_train_batch_size=MICRO, micro_rollout_batch_size=MICRO,
                            loss_aggregation="token-mean", tensor_parallel={"size": split})
    cfg = ModelConfig(role="actor", path=model_path, model=ModelSpec(path=model_path, dtype="float32"),
                      training=training, optimizer_steps=STEPS, algorithm="grpo")
    rank = torch.distributed.get_rank()
    model = load_model(cfg, rank, ranks)
    experience = _experience(len(model.tokenizer))
    with torch.no_grad(), model.scoring():
        log_probs = model.action_log_probs(experience.sequences, experience.attention_mask, experience.num_actions)

    grads = {}

    def keep_first_gradients(optimizer, args, kwargs):
        if grads:
            return
        for name, param in model.engine.module.named_parameters():
            grad = param.grad
            if is_sharded(param):  # this rank's shard: gathered along the dimension AutoTP split
                dim = param.ds_autotp_universal_checkpoint_meta["partition_dim"]
                parts = [torch.empty_like(grad) for _ in range(split)]
                torch.distributed.all_gather(parts, grad.contiguous(),
                                             group=deepspeed.utils.groups.get_tensor_model_parallel_group())
                grad = torch.cat(parts, dim)
            grads[name] = grad.clone()

    model.engine.optimizer.register_step_pre_hook(keep_first_gradients)
    data_parallel = ranks // split
    per_rank = same_rows(micro_batches_per_rank(experience, data_parallel, train_batch_size=TRAIN_BATCH,
                                                micro_batch_size=MICRO, epochs=1,
                                                generator=torch.Generator().manual_seed(0)), split)[rank]
    per_step = len(per_rank) // STEPS
    metrics = [mean_over_micro_batches(model, policy_step, per_rank[step * per_step:(step + 1) * per_step])
               for step in range(STEPS)]
    grad_norms = list(model.grad_norms)
    return {
        "log_probs": log_probs, "loss": [m["policy_loss"] for m in metrics], "grad_norms": grad_norms,
        "grads": grads, "weights": {name: t.clone() for name, t in weights.named_full_parameters(model)},
        "shapes": weights.full_shapes(model),
        "sent": [torch.cat([t.reshape(-1) for _, t in bucket]) for bucket in
                 weights.merged_buckets(model, torch.float32, bucket_bytes=64 << 10)],
        "shard_rows": [tuple(p.shape) for name, p in model.engine.module.named_parameters() if "q_proj.weight" in name],
    }


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
    results["split"] = _run(model_path, 2, 2)
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


if __name__ == "__main__":  # one rank of the pair: rank, model, port of the single run, port of the pair, output
    _rank_main(int(sys.argv[1]), sys.argv[2], [int(p) for p in sys.argv[3:5]], sys.argv[5])
