"""What only a GPU can prove, on one GPU in a few minutes: `python benchmarks/gpu_check.py` (torch with
CUDA, transformers, deepspeed and this repository; no vLLM, no Ray, no network). `--device cpu` runs the
same code on CPU (gloo, shared memory), as the suite does (tests/trainer/test_gpu_check.py).

Each check uses the trainer's own code: a real ModelWorker (one rank, its DeepSpeed ZeRO-3 engine in
bf16, its default group over NCCL), its weight-sync sender, and on the receiving side what a vLLM worker
runs (weight_sync.Handles and _unpack) in a second process.

1. packing: packed and padded log-probs (workers/packing.py) and their gradients agree under sdpa;
2. zero3-step: one ZeRO-3 bf16 training step over NCCL, its peak and what the process holds after it, with
   and without emptying the caching allocator (the figures memory_plan.py estimates);
3. ipc-sync: the actor's weights sent through CUDA IPC handles to a second process SYNCS times: every
   weight's checksum equal to the sender's, the receiver's memory not growing, GB/s;
4. broadcast: a one-rank NCCL broadcast group (weight_sync.SyncGroup).

--autocast trains float32 weights under training.bf16 (torch autocast) and syncs them in bfloat16, the CPU
examples' precision, instead of bfloat16 weights.

Prints one line per check and writes every figure to --out (JSON); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("operator", "trainer_image")]

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec  # noqa: E402
from rlhf_trainer.tiny import build_tiny_model  # noqa: E402
from rlhf_trainer.workers.distributed import open_store  # noqa: E402
from rlhf_trainer.workers.engine import ModelConfig  # noqa: E402
from rlhf_trainer.workers.model_worker import ModelWorker  # noqa: E402
from rlhf_trainer.workers.packing import pack, unpack_logits  # noqa: E402
from rlhf_trainer.workers.transfer_plan import HANDLES, Route  # noqa: E402

SYNCS = 20
BUCKET_BYTES = 64 << 20
TIMEOUT = timedelta(minutes=2)
ROUTE = Route(engine=0, worker=0, bundle=0, sender=0, via=HANDLES)  # the receiver on the sender's device


def _batch(vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows of prompts left-padded and responses right-padded, as the trainer lays out a rollout."""
    generator = torch.Generator().manual_seed(0)
    rows, prompt, response = [(37, 20), (5, 64), (60, 3), (12, 41)], 64, 64
    sequences = torch.zeros(len(rows), prompt + response, dtype=torch.long)
    mask = torch.zeros_like(sequences)
    for row, (p, r) in enumerate(rows):
        sequences[row, prompt - p:prompt + r] = torch.randint(3, vocab, (p + r,), generator=generator)
        mask[row, prompt - p:prompt + r] = 1
    return sequences.to(device), mask.to(device), response


def check_packing(path: Path, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhf_trainer.losses import token_log_probs
    from rlhf_trainer.workers.engine import position_ids

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device)
    sequences, mask, actions = _batch(model.config.vocab_size, device)
    packed = pack(sequences, mask, actions)
    read = {
        "packed": lambda: unpack_logits(model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                              logits_to_keep=packed.keep, use_cache=False).logits, packed),
        "padded": lambda: model(input_ids=sequences, attention_mask=mask, position_ids=position_ids(mask),
                                logits_to_keep=actions + 1).logits[:, :-1],
    }
    valid = mask[:, -actions:].bool()
    log_probs, grads = {}, {}
    for way, logits in read.items():
        model.zero_grad()
        values = token_log_probs(logits().float(), sequences[:, -actions:])
        values[valid].sum().backward()
        log_probs[way] = values[valid].detach()
        grads[way] = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    log_prob_gap = (log_probs["packed"] - log_probs["padded"]).abs().max().item()
    grad_gap = ((grads["packed"] - grads["padded"]).norm() / grads["padded"].norm()).item()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
    return {"log_prob_max_abs_diff": log_prob_gap, "grad_relative_diff": grad_gap,
            "ok": log_prob_gap < tolerance * 10 and grad_gap < tolerance}


def _memory(device: str) -> dict:
    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30, "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "process_gib": (total - free) / 2**30}


def check_zero3_step(worker: ModelWorker, device: str) -> dict:
    model = worker.model
    sequences, mask, actions = _batch(model.engine.module.config.vocab_size, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    log_probs = model.action_log_probs(sequences, mask, actions)
    loss = -(log_probs * mask[:, -actions:]).sum() / mask[:, -actions:].sum()
    model.backward_step(loss)
    if device == "cuda":
        torch.cuda.synchronize()
    figures = {"step_seconds": time.perf_counter() - started, "loss": loss.item(),
               "grad_norm": model.take_grad_norm(), "after_step": _memory(device),
               "batch": list(sequences.shape)}
    if device == "cuda":
        # the step's peak, held state included: what memory_plan's train phase bounds (tests/trainer/test_memory_plan.py)
        figures["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        figures["after_empty_cache"] = _memory(device)
        # what the process holds beyond the allocator's pool: the CUDA context, cuBLAS' workspace, NCCL's buffers
        figures["context_gib"] = figures["after_empty_cache"]["process_gib"] - figures["after_empty_cache"]["reserved_gib"]
    figures["ok"] = figures["grad_norm"] is not None and torch.isfinite(torch.tensor(figures["grad_norm"])).item()
    return figures


def _receive(port: int, device: str, announced: list, dtype_name: str, results) -> None:
    """The receiving side, as a vLLM worker runs it: open each bucket's handle, cut it into weights."""
    from rlhf_trainer.workers.distributed import join_store
    from rlhf_trainer.workers.weight_sync import Handles, _unpack, sync_store

    torch_device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    source = Handles(sync_store(join_store("127.0.0.1", port, 1, TIMEOUT)), ROUTE, torch_device)
    for _ in range(SYNCS):
        checksums = {name: weight.double().sum().item()
                     for name, weight in _unpack(source, announced, getattr(torch, dtype_name), BUCKET_BYTES)}
        source.done()
        results.put((checksums, torch.cuda.memory_allocated() if device == "cuda" else 0))


def check_ipc_sync(worker: ModelWorker, device: str, dtype_name: str) -> dict:
    from rlhf_trainer.workers import weights

    worker.sync_store = open_store(1, TIMEOUT)
    announced = worker.weight_shapes()
    sent = getattr(torch, dtype_name)  # the weights as the sync sends them (float32 weights in bfloat16: autocast's)
    expected = {name: tensor.to(sent).double().sum().item() for name, tensor in weights.named_full_parameters(worker.model)}
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=_receive, args=(worker.sync_store.port, device, announced, dtype_name, results))
    receiver.start()
    worker.join_weight_sync("127.0.0.1", worker.sync_store.port, 1, [ROUTE])
    size = sum(tensor.numel() for _, tensor in weights.named_full_parameters(worker.model)) * getattr(torch, dtype_name).itemsize
    seconds, held, equal = [], [], True
    for _ in range(SYNCS):
        started = time.perf_counter()
        worker.send_weights(dtype_name, BUCKET_BYTES)
        checksums, allocated = results.get(timeout=TIMEOUT.total_seconds())
        seconds.append(time.perf_counter() - started)
        held.append(allocated)
        equal &= checksums.keys() == expected.keys() and all(
            abs(checksums[name] - value) <= 1e-6 * max(1.0, abs(value)) for name, value in expected.items())
    receiver.join(timeout=60)
    growth = held[-1] - held[1] if len(held) > 1 else 0  # after the first sync, nothing should pile up
    median = sorted(seconds)[len(seconds) // 2]
    return {"syncs": SYNCS, "bytes": size, "median_seconds": median, "gb_per_s": size / median / 1e9,
            "checksums_equal": equal, "receiver_growth_bytes": growth,
            "ok": equal and growth <= 0 and receiver.exitcode == 0}


def check_broadcast(device: str) -> dict:
    from rlhf_trainer.workers.weight_sync import SyncGroup, sync_store

    torch_device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    group = SyncGroup(sync_store(open_store(1, TIMEOUT)), 0, 1, torch_device)
    tensor = torch.arange(1 << 20, dtype=torch.float32, device=torch_device)
    group.send(tensor)
    return {"ok": torch.equal(tensor.cpu(), torch.arange(1 << 20, dtype=torch.float32))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", default=None, help="rlhf_trainer.tiny SHAPES (default: qwen2-40m on cuda, tiny on cpu)")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--autocast", action="store_true", help="float32 weights with training.bf16: the step under "
                        "torch autocast, the weights synced in bfloat16 (spec.engine_dtype)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to check the same code on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dtype_name = "bfloat16" if cuda else "float32"
    weights_dtype, sync_dtype = ("float32", "bfloat16") if args.autocast else (dtype_name, dtype_name)
    path = build_tiny_model(Path(tempfile.mkdtemp()) / "model", shape=args.shape or ("qwen2-40m" if cuda else "tiny"))
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "dtype": dtype_name, "weights_dtype": weights_dtype, "sync_dtype": sync_dtype,
              "model_config": json.loads((path / "config.json").read_text())}
    report["packing"] = check_packing(path, args.device, getattr(torch, dtype_name))

    worker = ModelWorker(0, 1)
    worker.store = open_store(1, TIMEOUT)
    training = TrainingSpec(zero_stage=3, bf16=cuda or args.autocast, micro_train_batch_size=4, micro_rollout_batch_size=4,
                            train_batch_size=4, learning_rate=1e-5)
    worker.setup(ModelConfig(role="actor", path=str(path), model=ModelSpec(path=str(path), dtype=weights_dtype),
                             training=training, use_gpu=cuda), "127.0.0.1", worker.store.port)
    report["training"] = training.model_dump(mode="json", by_alias=True, exclude_unset=True)
    report["after_load"] = _memory(args.device)
    report["zero3_step"] = check_zero3_step(worker, args.device)
    report["ipc_sync"] = check_ipc_sync(worker, args.device, sync_dtype)
    report["broadcast"] = check_broadcast(args.device)

    args.out.write_text(json.dumps(report, indent=2))
    for name in ("packing", "zero3_step", "ipc_sync", "broadcast"):
        figures = {k: v for k, v in report[name].items() if k != "ok"}
        print(f"{name:11} {'ok' if report[name]['ok'] else 'FAILED'}  {figures}")
    print(f"figures in {args.out}")
    return 0 if all(report[name]["ok"] for name in ("packing", "zero3_step", "ipc_sync", "broadcast")) else 1


if __name__ == "__main__":
    sys.exit(main())
