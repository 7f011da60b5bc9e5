"""The Ray side of placement and a group of ranks called in parallel: the placement group that reserves the
bundles rlhf_api.planning.placement plans, the model groups and vLLM engines on them.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable

import ray
import torch
from kubernetes.utils import parse_quantity
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import Tensor

from rlhf_api.planning.memory import ranks_per_copy
from rlhf_api.planning.placement import ROLLOUT, Placement
from rlhf_api.v1alpha1 import RLHFJobSpec, StepReward

from ..experience import Experience
from .engine import ModelConfig
from .model_worker import ModelWorker
from .packing import longest_first
from . import tensor_parallel, threads
from .rollout import CONCURRENCY_GROUPS, RolloutEngine, engine_env


PLACEMENT_TIMEOUT = 300  # seconds the bundles get to be placed once the cluster has their resources in all


class PlacementTimeout(RuntimeError):
    """The placement group was not placed in time: no set of nodes can hold its bundles."""


def create_placement_group(placement: Placement, timeout: float = PLACEMENT_TIMEOUT) -> PlacementGroup:
    """Reserve the bundles; raises PlacementTimeout, saying what each node has free, when Ray cannot place
    them within `timeout` seconds (a bundle must fit on one node: resources spread over several do not)."""
    group = placement_group(placement.bundle_resources, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(group)
        free = ray._private.state.available_resources_per_node()  # noqa: SLF001 - Ray's own view, once
        nodes = "; ".join(f"node {node['NodeID'][:12]} at {node['NodeManagerAddress']}: "
                          f"{_cpus_and_gpus(free.get(node['NodeID'], {}))}" for node in ray.nodes() if node["Alive"])
        hint = ("give the worker pods at least one CPU per GPU (resources.worker.cpu)" if placement.use_gpu
                else "give the worker pods more CPUs (resources.worker.cpu), or run fewer ranks")
        raise PlacementTimeout(
            f"the {placement.bundles} bundles of {placement.bundle} (one per rank and vLLM worker) were not placed in "
            f"{timeout:g}s: each bundle needs one Ray node with all of it, and the nodes have free: {nodes}. To fit, "
            f"{hint}")
    return group


def _cpus_and_gpus(resources: dict[str, float]) -> str:
    return ", ".join(f"{kind} {resources.get(kind, 0):g}" for kind in ("CPU", "GPU"))


def _on_bundle(group: PlacementGroup, placement: Placement, bundle: int, **extra) -> dict:
    share = placement.share(bundle)
    return dict(
        num_cpus=share, num_gpus=share if placement.use_gpu else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle), **extra,
    )


def trained_rank_env(spec: RLHFJobSpec, use_gpu: bool) -> dict[str, str]:
    """The environment of a trained model's ranks. With offloadOptimizer on GPUs DeepSpeed's CPU Adam steps
    the optimizer on the worker pod's CPUs, as many OpenMP threads as the pod has CPUs per GPU: Ray gives an
    actor of a fraction of a CPU (one per bundle, shared) OMP_NUM_THREADS=1, one thread for a model's step."""
    if not (use_gpu and spec.training.offload_optimizer):
        return {}
    cpus = float(parse_quantity(spec.resources.worker.cpu))
    return {"OMP_NUM_THREADS": str(max(1, int(cpus // spec.resources.gpus_per_node)))}


class ModelGroup:
    """The ranks of one role (one DeepSpeed data-parallel group), called together."""

    def __init__(self, role: str, group: PlacementGroup, placement: Placement, env: dict[str, str] | None = None):
        worker = ray.remote(ModelWorker)
        bundles = placement.ranks[role]
        self.role = role
        self.base = False  # read with LoRA adapters off (base_model_view)
        self.split = 1  # consecutive ranks that split one copy of the model and read the same rows (tensor_parallel.py)
        env = {**(env or {}), **({} if placement.use_gpu else threads.CPU_ENV)}
        runtime_env = {"runtime_env": {"env_vars": env}} if env else {}
        self.workers = [
            worker.options(**_on_bundle(group, placement, bundle, **runtime_env)).remote(rank, len(bundles))
            for rank, bundle in enumerate(bundles)
        ]

    def base_model_view(self, role: str) -> ModelGroup:
        """The same ranks, their forward passes read from the base model (LoRA adapters off): `role`
        served without a model of its own (Placement.shared)."""
        view = copy.copy(self)
        view.role, view.base = role, True
        return view

    @property
    def size(self) -> int:
        return len(self.workers)

    def setup(self, cfg: ModelConfig) -> list[ray.ObjectRef]:
        """Load the model on every rank (wait on the returned refs)."""
        master_addr, master_port = ray.get(self.workers[0].open_rendezvous.remote())
        self.split = ranks_per_copy(cfg.role, cfg.training)
        return [w.setup.remote(cfg, master_addr, master_port) for w in self.workers]

    def call(self, method: str, *args) -> list[ray.ObjectRef]:
        """The same call on every rank (collectives need them all); one ObjectRef per rank."""
        return [getattr(w, method).remote(*args) for w in self.workers]

    def _shards(self, count: int) -> tuple[list[slice], int]:
        """Each rank's row range, after padding `count` rows to a multiple of the data-parallel ranks: equal ranges,
        one per data-parallel rank, the same for the ranks of a split (read back with `_outputs`)."""
        data_parallel = self.size // self.split
        per_rank = -(-count // data_parallel)
        ranges = [slice(r * per_rank, (r + 1) * per_rank) for r in range(data_parallel)]
        return tensor_parallel.same_rows(ranges, self.split), per_rank * data_parallel - count

    def _outputs(self, refs: list[ray.ObjectRef]) -> list:
        """Each data-parallel rank's output, in rank order (one of each split's ranks)."""
        return tensor_parallel.one_per_split(ray.get(refs), self.split)

    def forward(self, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                vision: dict[str, Tensor] | None = None) -> Tensor:
        """Log-probs or values [B, T], the batch split over the ranks; vision: the rows' image inputs."""
        return self.start_forward(sequences, attention_mask, num_actions, vision)()

    def start_forward(self, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                      vision: dict[str, Tensor] | None = None) -> Callable[[], Tensor]:
        """`forward` sent to the ranks without waiting: calling the result waits for its output, so
        other groups can work on their passes meanwhile."""
        rows = sequences.shape[0]
        pad = self._shards(rows)[1]
        shards, sequences, attention_mask = self._padded(sequences, attention_mask)
        vision = vision and {key: torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) for key, t in vision.items()}
        refs = [w.forward.remote(sequences[s], attention_mask[s], num_actions, self.base,
                                 vision and {key: t[s] for key, t in vision.items()})
                for w, s in zip(self.workers, shards)]
        return lambda: torch.cat(self._outputs(refs))[:rows]

    def _padded(self, sequences: Tensor, attention_mask: Tensor) -> tuple[list[slice], Tensor, Tensor]:
        """Each rank's rows, and the batch padded by repeating its last row so that every ZeRO-3 rank
        runs the same number of forward passes."""
        shards, pad = self._shards(sequences.shape[0])
        return (shards, torch.cat([sequences, sequences[-1:].expand(pad, -1)]),
                torch.cat([attention_mask, attention_mask[-1:].expand(pad, -1)]))

    def start_top_log_probs(self, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                            k: int) -> Callable[[], tuple[Tensor, Tensor]]:
        """The k likeliest tokens' log-probs and ids at each response position [B, T, k] (ModelWorker's),
        the batch split over the ranks; sent without waiting, as `start_forward`."""
        rows = sequences.shape[0]
        shards, sequences, attention_mask = self._padded(sequences, attention_mask)
        refs = [w.top_log_probs.remote(sequences[s], attention_mask[s], num_actions, k)
                for w, s in zip(self.workers, shards)]
        return lambda: tuple(torch.cat(side)[:rows] for side in zip(*self._outputs(refs)))

    def score(self, prompts: list[str], completions: list[str], steps: StepReward | None = None) -> Tensor:
        """Reward-model scores [B], the texts split over the ranks (a `type: model` reward source's scorer;
        steps: read step by step, see ModelWorker.score)."""
        shards, pad = self._shards(len(prompts))
        prompts, completions = prompts + prompts[-1:] * pad, completions + completions[-1:] * pad
        scores = self._outputs([w.score.remote(prompts[s], completions[s], steps) for w, s in zip(self.workers, shards)])
        return torch.cat(scores)[: len(prompts) - pad]

    def train(self, experience: Experience, **split) -> list[ray.ObjectRef]:
        """Each data-parallel rank trains its micro-batches (`micro_batches_per_rank(experience, ranks, **split)`),
        the ranks of a split the same ones.
        Returns each rank's metrics (see mean_metrics), so groups can train at once."""
        per_rank = tensor_parallel.same_rows(micro_batches_per_rank(experience, self.size // self.split, **split),
                                             self.split)
        return [w.train.remote(batches) for w, batches in zip(self.workers, per_rank)]


def micro_batches_per_rank(experience: Experience, ranks: int, *, train_batch_size: int, micro_batch_size: int,
                           epochs: int, generator: torch.Generator) -> list[list[Experience]]:
    """`epochs` shuffled passes; each optimizer step takes trainBatchSize samples, dealt out to the ranks
    longest first (each rank about the same tokens), each rank's cut into micro-batches of like lengths:
    a micro-batch pads (or packs) to its longest row, so mixed lengths waste compute (a quarter of the
    SmolLM2 example's update: benchmarks/README.md). Which micro-batch holds a row leaves the step's
    gradient as it is (every loss aggregation weighs a step's rows alike over equal micro-batches).
    Every sample carries the valid token count of its whole step (step_tokens): the driver alone sees
    every rank's micro-batches."""
    per_rank: list[list[Experience]] = [[] for _ in range(ranks)]
    for _ in range(epochs):
        order = torch.randperm(experience.batch_size, generator=generator)
        for start in range(0, experience.batch_size, train_batch_size):
            step_rows = order[start:start + train_batch_size]
            step_rows = step_rows[longest_first(experience.attention_mask[step_rows])]
            tokens = experience.action_mask[step_rows].sum()
            for rank in range(ranks):
                rows = step_rows[rank::ranks]
                rank_rows = replace(experience.select(rows), step_tokens=tokens.expand(len(rows)).clone())
                per_rank[rank] += rank_rows.split(micro_batch_size)
    return per_rank


def mean_metrics(refs: list[ray.ObjectRef]) -> dict[str, float]:
    results = ray.get(refs)
    return {key: sum(r[key] for r in results) / len(results) for key in results[0]}


def create_rollout_engines(group: PlacementGroup, placement: Placement, model_path: str, **engine_options) -> list:
    """One RolloutEngine actor per engine, on its first bundle (a tensor-parallel engine's workers run
    beside it, on its other bundles' devices); engine i is seeded seed + i."""
    engine, seed = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RolloutEngine), engine_options.pop("seed")
    return [engine.options(**_on_bundle(group, placement, first, runtime_env={
                "env_vars": _engine_env(group, placement, first)})).remote(
                model_path, use_gpu=placement.use_gpu, seed=seed + index, **engine_options)
            for index, first in enumerate(placement.ranks[ROLLOUT])]


@ray.remote(num_cpus=0)
def _node_and_gpus() -> tuple[str, list[str]]:
    return ray.get_runtime_context().get_node_id(), [str(gpu) for gpu in ray.get_gpu_ids()]


def _engine_env(group: PlacementGroup, placement: Placement, first: int) -> dict[str, str]:
    """The environment of the engine on bundles first... (engine_width of them). Its tensor-parallel
    workers are vLLM's processes beside the actor, so the bundles must be on the actor's node; on GPUs
    the actor is shown their GPUs (Ray shows an actor only its own bundle's), which a task on each
    bundle reads."""
    env = engine_env(placement.use_gpu)
    if placement.engine_width == 1:
        return env
    bundles = range(first, first + placement.engine_width)
    where = ray.get([_node_and_gpus.options(
        num_gpus=0.01 if placement.use_gpu else 0,  # a GPU task is told its bundle's GPU
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)).remote()
        for bundle in bundles])
    nodes = {node for node, _ in where}
    if len(nodes) > 1:
        raise RuntimeError(
            f"Ray placed the {len(bundles)} bundles of a vLLM engine (rollout.tensorParallelSize) on "
            f"{len(nodes)} nodes, and an engine's workers share one node. Set "
            "resources.gpusPerNode to a multiple of rollout.tensorParallelSize and ask no GPUs of the roles "
            "(resources.gpus) that would leave an engine astride two nodes")
    if placement.use_gpu:
        env = {**env, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
               "CUDA_VISIBLE_DEVICES": ",".join(gpu for _, gpus in where for gpu in gpus)}
    return env
