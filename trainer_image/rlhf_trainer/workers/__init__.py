"""Ray actors of a run: model groups (DeepSpeed), vLLM rollout engines, and the weight sync between them."""

from __future__ import annotations

import sys


def an_actor_s_own_process() -> bool:
    """Whether this process is a Ray actor's own, not one that runs a rank or an engine in-process (a test, the GPU
    check): what such a process loads lives as long as it does (rlhf_api.startup's freeze). Ray is looked up, not
    imported: a process without it (the GPU check) runs no actor and stays without it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
