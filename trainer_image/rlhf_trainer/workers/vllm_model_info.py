"""vLLM's facts about a model class (multimodal, LoRA, pooling ...), found ahead of every engine's start.

On each start an engine looks its model's class up in VLLM_CACHE_ROOT/modelinfos, keyed by a hash of the
class's module file; on a miss it inspects the class in a child process (imports torch and the model's
module, on GPUs CUDA's libraries: seconds of every pod's start, ~12 CPU-seconds on this project's CPU test
machines) and writes the answer there. A pod's home starts empty each time, so every engine on a cluster
paid it. The trainer image runs this module at its build, as its user, for the architectures the examples
serve: the pods' engines find their entries in the image's home. Another architecture is inspected at its
engine's start, as before.
"""

from __future__ import annotations

import sys

# The examples' models: Llama 3 and SmolLM2, Qwen2.5 and the tiny test model (Qwen2), Qwen2.5-VL and the
# tiny VLM (Qwen2-VL).
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen2VLForConditionalGeneration",
                 "Qwen2_5_VLForConditionalGeneration")


def warm() -> None:
    """Inspect each architecture once (vLLM writes its cache entry). One that cannot be is reported, not
    raised: its engines inspect it at their start, so the image still builds and works."""
    from vllm.model_executor.models.registry import ModelRegistry

    for architecture in ARCHITECTURES:
        try:
            ModelRegistry.models[architecture].inspect_model_cls()
        except Exception as error:  # noqa: BLE001 - reported, and the engines inspect it themselves
            print(f"vLLM's model info for {architecture} not cached ({type(error).__name__}: {error}); "
                  "its engines inspect it at their start", file=sys.stderr)


if __name__ == "__main__":
    warm()
