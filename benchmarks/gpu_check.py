"""What only a GPU can prove, on one GPU in a few minutes: `python benchmarks/gpu_check.py` (torch with
CUDA and Triton, transformers, deepspeed, pydantic, common-expression-language (the memory plan's validation)
and this repository; no vLLM, no Ray, no network). `--device cpu` runs the same code on CPU (gloo, shared
memory), as the suite does (tests/trainer/test_gpu_check.py).

Each check uses the trainer's own code: a real ModelWorker (one rank, its DeepSpeed ZeRO-3 engine in
bf16, its default group over NCCL), its weight-sync sender, and on the receiving side what a vLLM worker
runs (weight_sync.Handles and _unpack) in a second process.

1. packing: packed and padded log-probs (workers/packing.py) and their gradients agree under sdpa;
2. zero3-step: one ZeRO-3 bf16 training step over NCCL, its peak and what the process holds after it, with
   and without emptying the caching allocator (the figures planning/memory.py estimates);
3. ipc-sync: the actor's weights sent through CUDA IPC handles to a second process SYNCS times: every
   weight's checksum equal to the sender's, the receiver's memory not growing, GB/s;
4. broadcast: a one-rank NCCL broadcast group (weight_sync.SyncGroup);
5. ipc-device: a tensor on cuda:1 through the same handles to a process that sees every GPU and one that sees only
   that GPU (vLLM workers number their devices either way): checksums equal, opened on the sender's GPU (its UUID).
   Needs 2 GPUs: skipped, with the reason, on one;
6. triton: a Triton vector add compiled and launched here, against torch's sum, with the C compiler Triton found
   ($CC, gcc, clang): Triton builds its launcher with one the first time a kernel runs, as vLLM's first step does
   (a cold TRITON_CACHE_DIR, so the build happens). Skipped on CPU;
7. turns: an actor and a reference, two ModelWorkers each in its own process on the one GPU as the trainer places
   them, load, score the same batch in turn, release_memory in turn, and the actor trains a step; after each, the
   GPU's free memory (torch.cuda.mem_get_info, every process's use) and the process's allocated and reserved
   bytes (on CPU its resident set): whether a pass hands its cached blocks back before the next one runs;
8. plan-terms: the memory plan's terms (rlhf_api/planning/memory.py) for the turns' model against what its
   processes measured: the weights (the reference's allocated bytes after its load), what a trained rank holds
   beyond them (the actor's after its step), one micro-batch's step (its peak over that) and the train phase,
   which must bound the peak. The model fits one GPU: --plan-config, by default Qwen2.5-0.5B's layout with random
   weights. On CPU: the tiny model, the parameters' and live tensors' sizes for the allocator's counts, no peak.

What it does not prove: the trainer image (the checks run in the GPU machine's Python environment; the CUDA image
keeping a compiler is checked from its recipe, tests/test_dockerfiles.py), vLLM's own process (its CUDA graphs,
sleep and wake, its KV cache), tensor parallelism, NCCL between GPUs or nodes (every group has one rank), RDMA, a
model larger than one GPU, or a job's step time; the plan is measured for one trained rank alone, not for the
colocated roles of a real job.

--autocast trains float32 weights under training.bf16 (torch autocast) and syncs them in bfloat16, the CPU
examples' precision, instead of bfloat16 weights.

Prints one line per check and writes every figure to --out (JSON); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / d) for d in ("operator", "trainer_image")]

from rlhf_api.planning.memory import GIB, Shape, plan_memory  # noqa: E402
from rlhf_api.planning.placement import Placement  # noqa: E402
from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec  # noqa: E402
from rlhf_api.validation import validate  # noqa: E402
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
PLAN_CONFIG = ROOT / "manifests" / "examples" / "model-configs" / "Qwen" / "Qwen2.5-0.5B-Instruct" / "config.json"
TURNS = [("actor", "load"), ("reference", "load"), ("actor", "score"), ("reference", "score"), ("actor", "release"),
         ("reference", "release"), ("actor", "train")]  # (worker, step): the trainer's order on a shared GPU


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


def _open_on_device(port: int, route: Route, index: int, numel: int, results) -> None:
    """A receiver of a HANDLES route that opens the bucket on its own cuda:index, as a vLLM worker does."""
    from rlhf_trainer.workers.distributed import join_store
    from rlhf_trainer.workers.weight_sync import Handles, sync_store

    source = Handles(sync_store(join_store("127.0.0.1", port, 1, TIMEOUT)), route, torch.device("cuda", index))
    tensor = source.receive(numel, torch.float32)
    results.put((route.worker, tensor.double().sum().item(), str(torch.cuda.get_device_properties(tensor.device).uuid)))


def check_ipc_device(device: str) -> dict:
    """A tensor on cuda:1 through the handles path to two receivers: one that sees every GPU (it opens cuda:1)
    and one that sees only that GPU (cuda:0 to it), as each vLLM worker numbers its devices."""
    from rlhf_trainer.workers.weight_sync import Handles, sync_store

    count = torch.cuda.device_count() if device == "cuda" else 0
    if count < 2:
        return {"skipped": f"needs 2 GPUs, {count} here", "ok": True}
    store = open_store(1, TIMEOUT)
    tensor = torch.randn(1 << 20, device="cuda:1")
    expected, uuid = tensor.double().sum().item(), str(torch.cuda.get_device_properties(1).uuid)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    routes = [Route(engine=0, worker=worker, bundle=0, sender=0, via=HANDLES) for worker in (0, 1)]
    senders = [Handles(sync_store(store), route, tensor.device) for route in routes]
    receivers = [context.Process(target=_open_on_device, args=(store.port, route, index, tensor.numel(), results))
                 for route, index in zip(routes, (1, 0))]
    receivers[0].start()  # sees the GPUs this process sees
    # sees only the sender's GPU: a spawned process reads CUDA_VISIBLE_DEVICES at its first CUDA call
    os.environ["CUDA_VISIBLE_DEVICES"] = visible.split(",")[1] if visible else "1"
    receivers[1].start()
    if visible is None:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    for sender in senders:
        sender.send(tensor)
        sender.done()
    opened = dict((worker, (checksum, at)) for worker, checksum, at in
                  (results.get(timeout=TIMEOUT.total_seconds()) for _ in receivers))
    for receiver in receivers:
        receiver.join(timeout=60)
    equal = all(abs(checksum - expected) <= 1e-6 * max(1.0, abs(expected)) for checksum, _ in opened.values())
    same_gpu = all(at == uuid for _, at in opened.values())
    return {"gpus": count, "checksums_equal": equal, "same_gpu": same_gpu,
            "ok": equal and same_gpu and all(r.exitcode == 0 for r in receivers)}


def check_triton(device: str) -> dict:
    """A vector add written in Triton, compiled and launched in this environment: Triton builds its launcher
    with $CC, else gcc, else clang, against Python.h, the first time a kernel runs."""
    compiler = {"CC": os.environ.get("CC"), **{name: shutil.which(name) for name in ("gcc", "clang", "cc")}}
    if device != "cuda":
        return {"skipped": "Triton compiles for a GPU", "compiler": compiler, "ok": True}
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cold cache: the launcher is built, not loaded
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = at < n
        tl.store(out + at, tl.load(x + at, mask=inside) + tl.load(y + at, mask=inside), mask=inside)

    x, y = torch.rand(2, 100_000, device="cuda")
    out = torch.empty_like(x)
    figures = {"triton": triton.__version__, "compiler": compiler}
    started = time.perf_counter()
    try:
        add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
        torch.cuda.synchronize()
    except Exception as error:  # what an image without a compiler meets at vLLM's first step
        return figures | {"error": f"{type(error).__name__}: {error}", "ok": False}
    return figures | {"compile_and_launch_seconds": time.perf_counter() - started, "ok": torch.equal(out, x + y)}


def _build_from_config(config: Path, tokenizer_from: Path, out: Path, device: str) -> Path:
    """Random bf16 weights in a published model's layout (its config.json), with the check's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True)
    shutil.copy(config, out / "config.json")
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(out)
    return out


def _seen(device: str) -> dict:
    """Memory after a step: on GPU the device's free memory (every process's use) and this process's allocator;
    on CPU this process's resident set."""
    if device == "cuda":
        return {"free_gib": torch.cuda.mem_get_info()[0] / GIB, "allocated_gib": torch.cuda.memory_allocated() / GIB,
                "reserved_gib": torch.cuda.memory_reserved() / GIB}
    return {"rss_gib": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB}


def _held(device: str) -> int:
    """Bytes this process's tensors hold: the allocator's count on GPU; on CPU, which has no such count, the
    distinct storages of the tensors still reachable."""
    if device == "cuda":
        return torch.cuda.memory_allocated()
    gc.collect()  # cycles of garbage still hold their tensors until collected
    storages = {}
    with warnings.catch_warnings():  # isinstance reads deprecated module attributes among gc's objects
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())


def _rank(cfg: ModelConfig, device: str, commands, results) -> None:
    """One model worker in a process of its own, as the trainer runs each model on a shared GPU: it runs each
    command it is sent (TURNS) and answers with what it sees of memory after it."""
    worker = ModelWorker(0, 1)
    for command in iter(commands.get, None):
        figures = {}
        if command == "load":
            worker.store = open_store(1, TIMEOUT)
            worker.setup(cfg, "127.0.0.1", worker.store.port)
            sequences, mask, actions = _batch(worker.model.engine.module.config.vocab_size, "cpu")
            figures = {"held_bytes": _held(device), "parameter_bytes": sum(
                p.ds_tensor.numel() * p.ds_tensor.element_size() for p in worker.model.engine.module.parameters())}
        elif command == "score":
            worker.forward(sequences, mask, actions)
        elif command == "release":
            worker.release_memory()
        else:  # train: the step's peak (GPU), then what stays held
            step = check_zero3_step(worker, device)
            peak = step["peak_allocated_gib"] * GIB if device == "cuda" else None
            figures = {"batch": step["batch"], "peak_bytes": peak, "held_bytes": _held(device)}
        results.put((cfg.role, command, _seen(device) | figures))


def start_ranks(path: Path, device: str, training: TrainingSpec, weights_dtype: str) -> tuple[list, dict, object]:
    """The turns' actor and reference processes, started before the other checks so that their imports overlap
    them; each loads its model only when its turn comes (check_turns)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    commands = {role: context.Queue() for role in ("actor", "reference")}
    configs = [ModelConfig(role=role, path=str(path), model=ModelSpec(path=str(path), dtype=weights_dtype),
                           training=training, use_gpu=device == "cuda", algorithm="sft") for role in commands]
    # daemons: a check that fails before the turns leaves no process waiting for a command
    ranks = [context.Process(target=_rank, args=(cfg, device, commands[cfg.role], results), daemon=True)
             for cfg in configs]
    for rank in ranks:
        rank.start()
    return ranks, commands, results


def check_turns(path: Path, ranks: list, commands: dict, results) -> dict:
    """The actor and the reference, each a ModelWorker in its own process on the one device, load, score and
    release in turn as the trainer's phases do; then the actor trains one step."""
    steps = []
    for role, command in TURNS:
        commands[role].put(command)
        while True:  # a 0.5B model's load takes a while; a rank that died fails the check now, not at a timeout
            try:
                _, _, figures = results.get(timeout=5)
                break
            except queue.Empty:
                if any(rank.exitcode is not None for rank in ranks):
                    raise RuntimeError(f"a rank exited before its turns: {[r.exitcode for r in ranks]}") from None
        steps.append({"worker": role, "step": command, **figures})
    for inbox in commands.values():
        inbox.put(None)
    for rank in ranks:
        rank.join(timeout=60)
    return {"model": str(path), "steps": steps, "ok": all(rank.exitcode == 0 for rank in ranks)}


def check_plan_terms(turns: dict, config: dict, training: dict, weights_dtype: str, device: str) -> dict:
    """The memory plan's terms for the turns' model trained alone on one GPU (an sft job's actor, as
    tests/trainer/test_memory_plan.py reads them) against what the turns measured: the weights a frozen model holds
    (the reference's after its load: the allocator's count on GPU, its parameters' sizes on CPU), what a trained
    rank holds beyond them (the actor's after its step), one micro-batch's step on top of that and the whole train
    phase (GPU only: the allocator's peak). It fails only where the measured train phase exceeds the plan's."""
    reference, actor = (next(s for s in turns["steps"] if (s["worker"], s["step"]) == key)
                        for key in (("reference", "load"), ("actor", "train")))
    rows, sequence = actor["batch"]
    spec = validate({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "gpu-check"}, "spec": {
        "algorithm": "sft", "models": {"actor": {"path": "model", "dtype": weights_dtype}},
        "data": {"sft": {"sources": [{"path": "data.jsonl"}]}, "maxTokens": sequence},
        "training": {**training, "microTrainBatchSize": rows}, "resources": {"nodes": 1, "gpusPerNode": 1}}}).spec
    shape = Shape.from_config(config)
    [planned] = plan_memory(spec, Placement(use_gpu=True, bundles=1, ranks={"actor": [0]}), {"actor": shape},
                            "80GiB").gpus[0].processes
    weights, held, peak = planned.held["weights"], sum(planned.held.values()), actor["peak_bytes"]
    measured_weights = reference["held_bytes"] if device == "cuda" else reference["parameter_bytes"]
    terms = {
        "weights": (weights, measured_weights),
        "held beyond the weights": (held - weights, actor["held_bytes"] - measured_weights),
        "one micro-batch's step": (planned.extra["train"], None if peak is None else peak - actor["held_bytes"]),
        "train phase": (held + planned.extra["train"], peak),
    }
    return {"params": shape.params, "planned_held_gib": {what: n / GIB for what, n in planned.held.items()},
            "terms": {name: {"planned_gib": plan / GIB, "measured_gib": None if seen is None else seen / GIB}
                      for name, (plan, seen) in terms.items()},
            "ok": peak is None or peak <= held + planned.extra["train"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", default=None, help="rlhf_trainer.tiny SHAPES (default: qwen2-40m on cuda, tiny on cpu)")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--autocast", action="store_true", help="float32 weights with training.bf16: the step under "
                        "torch autocast, the weights synced in bfloat16 (spec.engine_dtype)")
    parser.add_argument("--plan-config", type=Path, default=None, help="config.json of the model the turns and "
                        f"plan-terms checks build (default on cuda: {PLAN_CONFIG.relative_to(ROOT)}; on cpu: --shape's)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to check the same code on CPU", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dtype_name = "bfloat16" if cuda else "float32"
    weights_dtype, sync_dtype = ("float32", "bfloat16") if args.autocast else (dtype_name, dtype_name)
    path = build_tiny_model(Path(tempfile.mkdtemp()) / "model", shape=args.shape or ("qwen2-40m" if cuda else "tiny"))
    plan_config = args.plan_config or (PLAN_CONFIG if cuda else None)
    plan_model = path if plan_config is None else _build_from_config(
        plan_config, path, Path(tempfile.mkdtemp()) / "model", args.device)
    torch.cuda.empty_cache()  # the build's blocks: the other checks read the device's memory
    training = TrainingSpec(zero_stage=3, bf16=cuda or args.autocast, micro_train_batch_size=4, micro_rollout_batch_size=4,
                            train_batch_size=4, learning_rate=1e-5)
    ranks = start_ranks(plan_model, args.device, training, weights_dtype)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "dtype": dtype_name, "weights_dtype": weights_dtype, "sync_dtype": sync_dtype,
              "model_config": json.loads((path / "config.json").read_text())}
    report["packing"] = check_packing(path, args.device, getattr(torch, dtype_name))

    worker = ModelWorker(0, 1)
    worker.store = open_store(1, TIMEOUT)
    worker.setup(ModelConfig(role="actor", path=str(path), model=ModelSpec(path=str(path), dtype=weights_dtype),
                             training=training, use_gpu=cuda), "127.0.0.1", worker.store.port)
    report["training"] = training.model_dump(mode="json", by_alias=True, exclude_unset=True)
    report["after_load"] = _memory(args.device)
    report["zero3_step"] = check_zero3_step(worker, args.device)
    report["ipc_sync"] = check_ipc_sync(worker, args.device, sync_dtype)
    report["broadcast"] = check_broadcast(args.device)
    report["ipc_device"] = check_ipc_device(args.device)
    report["triton"] = check_triton(args.device)
    report["turns"] = check_turns(plan_model, *ranks)
    report["plan_terms"] = check_plan_terms(report["turns"], json.loads((plan_model / "config.json").read_text()),
                                            report["training"], weights_dtype, args.device)

    args.out.write_text(json.dumps(report, indent=2))
    checks = ("packing", "zero3_step", "ipc_sync", "broadcast", "ipc_device", "triton", "turns", "plan_terms")
    for name in checks:
        figures = {k: v for k, v in report[name].items() if k != "ok"}
        print(f"{name:11} {'ok' if report[name]['ok'] else 'FAILED'}  {figures}")
    print(f"figures in {args.out}")
    return 0 if all(report[name]["ok"] for name in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
