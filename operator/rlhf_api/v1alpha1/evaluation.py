"""spec.evaluation: held-out prompt sets scored during training, and the best checkpoint."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import DNS_LABEL, APIModel, cel
from .data import DatasetSource



class EvalDataset(APIModel):
    """One evaluation set: prompts (with labels for the reward) read like spec.data.prompts."""

    name: str = Field(pattern=DNS_LABEL, max_length=63)
    """Name of the set; its metrics are eval/<name>/mean_reward and eval/<name>/pass@<k>."""
    sources: list[DatasetSource] = Field(min_length=1, max_length=16)
    """The datasets to mix."""
    input_key: str = Field("prompt", max_length=128)
    """Record key of the prompt (a string, or a list of chat messages)."""
    label_key: str | None = Field(None, max_length=128)
    """Record key passed to reward functions and environments as the label."""
    image_key: str | None = Field(None, max_length=128)
    """Record key of the record's images, as data.prompts.imageKey (vision-language models)."""
    fetch_image_urls: bool = False
    """Read images given as http(s) URLs, as data.prompts.fetchImageUrls."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_samples: int | None = Field(None, ge=1)
    """Use at most this many records."""


class EvaluationSpec(APIModel):
    """Evaluation during training: every intervalSteps steps and after the last one, each set's prompts are sampled
    samplesPerPrompt times (with the rollout's engines, environment and reward) and scored: mean reward and pass@<k>
    (a sample passes when its reward reaches passThreshold; the unbiased estimator of Chen et al. 2021,
    arXiv:2107.03374). The results go to the metrics (eval/<set>/...), TensorBoard and status.metrics.evaluation;
    with bestMetric set, the actor with the best value so far is saved in Hugging Face format to
    checkpoint.path/best."""

    model_config = cel(
        ("self.datasets.all(d, self.datasets.exists_one(e, e.name == d.name))", "evaluation dataset names must be unique", ".datasets"),
        ("!has(self.bestMetric) || self.datasets.exists(d, self.bestMetric.startsWith(d.name + '/'))",
         "bestMetric must start with the name of one of evaluation.datasets: <set>/mean_reward or <set>/pass@k", ".bestMetric"),
        ("!has(self.temperature) || self.temperature > 0.0 || !has(self.samplesPerPrompt) || self.samplesPerPrompt == 1",
         "greedy decoding (temperature 0) gives one answer per prompt: set samplesPerPrompt 1, or a temperature above 0",
         ".samplesPerPrompt"),
        ("!has(self.passK) || self.passK <= self.samplesPerPrompt",
         "pass@k needs at least k samples of each prompt: set passK <= samplesPerPrompt", ".passK"),
    )

    datasets: list[EvalDataset] = Field(min_length=1, max_length=16)
    """The evaluation sets."""
    interval_steps: int = Field(0, ge=0)
    """Evaluate every N steps (and after the last one); 0 evaluates only after the last one."""
    at_start: bool = False
    """Also evaluate before the first step (step 0): the baseline."""
    samples_per_prompt: int = Field(1, ge=1, le=1024)
    """Samples of each prompt."""
    temperature: float = Field(0.0, ge=0, le=10)
    """Sampling temperature (0: greedy)."""
    pass_k: int | None = Field(None, ge=1)
    """k of pass@k; unset: samplesPerPrompt."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this: the task's own, unshaped (the reward sources' weighted sum plus the environment's episode reward; no rewardWeight, length penalty or clip), as for mean_reward."""
    best_metric: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/(mean_reward|pass@k)$", max_length=128)
    """Keep the best checkpoint by this metric: <set>/mean_reward or <set>/pass@k (the set's pass@<k>, e.g. pass@4)."""
    best_mode: Literal["max", "min"] = "max"
    """Whether the best value is the largest or the smallest."""
