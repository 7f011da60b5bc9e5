"""Weight sync alone (actor -> vLLM), timed as the trainer's time/weight_sync phase times it.

    PYTHONPATH=operator:trainer_image .venv/bin/python benchmarks/weight_sync.py --model-shape qwen2-40m \
        --placement separate --bucket-mib 256 --syncs 6

A ZeRO-3 actor on two CPU ranks and one vLLM-CPU engine, on the placement named (`separate`: the
engine on a bundle of its own, sent over the gloo broadcast group; `colocated`: the engine on actor
rank 0's bundle, sent through shared-memory handles), the model one of rlhf_trainer.tiny.SHAPES
(random weights, built offline) or `smollm2`, the real SmolLM2-135M-Instruct (rlhf smollm2-model). Each sync is `sync_weights` as the trainer calls it after an
update; the first is left out of the median (the receiving side's first reload allocates). Prints
one JSON line. --bucket-mib 0 sends each parameter on its own (one gather and one collective per
parameter: what the trainer did before buckets). Run from an older tree (PYTHONPATH pointing at
it), the script uses that tree's API (setup_broadcast_group) and ignores --bucket-mib.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import OFFLINE_ENV, git_commit  # noqa: E402

from rlhf_api.planning.placement import Placement  # noqa: E402
from rlhf_api.v1alpha1 import ModelSpec, RolloutSpec, TrainingSpec  # noqa: E402
from rlhf_trainer.tiny import SHAPES, build_tiny_model  # noqa: E402
from rlhf_trainer.workers import weight_sync  # noqa: E402
from rlhf_trainer.workers.engine import ModelConfig  # noqa: E402
from rlhf_trainer.workers.group import ModelGroup, create_placement_group, create_rollout_engines  # noqa: E402

PLACEMENTS = {"separate": ({"actor": [0, 1], "rollout": [2]}, 3), "colocated": ({"actor": [0, 1], "rollout": [0]}, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", choices=[*SHAPES, "smollm2"], default="qwen2-40m",
                        help="a random model of rlhf_trainer.tiny.SHAPES, or smollm2: the real SmolLM2-135M-Instruct")
    parser.add_argument("--placement", choices=PLACEMENTS, default="separate")
    parser.add_argument("--bucket-mib", type=float, default=256)
    parser.add_argument("--syncs", type=int, default=6)
    args = parser.parse_args()
    os.environ.update(OFFLINE_ENV, RAY_AUTH_MODE="disabled")
    work = Path(tempfile.mkdtemp(prefix="weight-sync-bench-"))
    if args.model_shape == "smollm2":
        from rlhf_trainer.pretrained import build_smollm2

        model_dir = build_smollm2(work / "model")
    else:
        model_dir = build_tiny_model(work / "model", shape=args.model_shape)
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp"),
             log_to_driver=False)
    ranks, bundles = PLACEMENTS[args.placement]
    placement = Placement(use_gpu=False, bundles=bundles, ranks=ranks)
    group = create_placement_group(placement)
    actor = ModelGroup("actor", group, placement)
    training = TrainingSpec(zero_stage=3, bf16=False, micro_train_batch_size=1, train_batch_size=2)
    engines = create_rollout_engines(group, placement, str(model_dir), rollout=RolloutSpec(), dtype="float32",
                                     max_model_len=256, seed=0)
    ray.get(actor.setup(ModelConfig(role="actor", path=str(model_dir), model=ModelSpec(path=str(model_dir),
                                    dtype="float32"), training=training)))
    if hasattr(weight_sync, "setup_broadcast_group"):  # an older tree: one collective per parameter
        weight_sync.setup_broadcast_group(actor, engines, 1)
        sync = lambda: weight_sync.sync_weights(actor, engines, dtype="float32")  # noqa: E731
    else:
        state = weight_sync.setup_weight_sync(actor, engines, placement, bucket_bytes=int(args.bucket_mib * 2**20))
        sync = lambda: weight_sync.sync_weights(state, dtype="float32")  # noqa: E731
    seconds = []
    for _ in range(args.syncs):
        started = time.perf_counter()
        sync()
        seconds.append(time.perf_counter() - started)
    print(json.dumps({
        "commit": git_commit(), "tree": weight_sync.__file__, "shape": args.model_shape, "placement": args.placement,
        "bucket_mib": None if hasattr(weight_sync, "setup_broadcast_group") else args.bucket_mib,
        "load_average": os.getloadavg(),
        "median_seconds": statistics.median(seconds[1:]), "seconds": seconds,
    }))
    ray.shutdown()


if __name__ == "__main__":
    main()
