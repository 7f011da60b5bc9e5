"""Ray actors of a run: model groups (DeepSpeed), vLLM rollout engines, and the weight sync between them."""
