"""spec.tracking: experiment trackers the run reports to besides TensorBoard and metrics.jsonl.

The run is named after the RLHFJob (namespace/name in a cluster, the job's name under `rlhf run`)
and carries its spec as the run's config. Credentials stay in Secrets: the operator sets them as
environment variables by reference (contract.py names them), never copying a value.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .. import contract
from .base import APIModel, cel
from .reward import SecretKeyRef


class WandbSpec(APIModel):
    """Weights & Biases (needs the trainer's `tracking` extra: pip install 'rlhf-operator[tracking]')."""

    project: str = Field(min_length=1, max_length=128)
    """W&B project the run is logged to."""
    entity: str | None = Field(None, max_length=128)
    """W&B team or user owning the project; unset: the API key's default entity."""
    group: str | None = Field(None, max_length=128)
    """Run group, to compare related runs together."""
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=32)
    """Run tags."""
    mode: Literal["online", "offline"] = "online"
    """online: stream to the W&B server; offline: write the run under checkpoint.path/logs/wandb only (upload later with `wandb sync`)."""
    base_url: str | None = Field(None, pattern=r"^https?://", max_length=2048)
    """Server of a self-hosted W&B (WANDB_BASE_URL); unset: W&B's cloud."""
    api_key_secret: SecretKeyRef | None = None
    """Secret key holding the W&B API key (set as WANDB_API_KEY by reference). Needed in online mode unless the image or resources.env provides one."""


class MLflowSpec(APIModel):
    """MLflow (needs the trainer's `tracking` extra: pip install 'rlhf-operator[tracking]')."""

    model_config = cel(
        ("has(self.usernameSecret) == has(self.passwordSecret)",
         "MLflow basic auth needs both usernameSecret and passwordSecret: set both, or neither", ".passwordSecret"),
    )

    tracking_uri: str = Field(pattern=r"^(https?://|file:)", max_length=2048)
    """Tracking server (http:// or https://), or a file store (file:///path, e.g. on a mounted volume; the trainer opts in to MLflow's file store, which MLflow otherwise refuses)."""
    experiment: str | None = Field(None, min_length=1, max_length=500)
    """Experiment the run is logged under (created if missing); unset: MLflow's Default experiment."""
    username_secret: SecretKeyRef | None = None
    """Secret key holding the basic-auth user name (MLFLOW_TRACKING_USERNAME)."""
    password_secret: SecretKeyRef | None = None
    """Secret key holding the basic-auth password (MLFLOW_TRACKING_PASSWORD)."""
    token_secret: SecretKeyRef | None = None
    """Secret key holding a bearer token (MLFLOW_TRACKING_TOKEN)."""


class TrackingSpec(APIModel):
    """Experiment trackers. TensorBoard events and metrics.jsonl are always written, to checkpoint.path/logs (on the checkpoint volume when checkpoint.pvc is set)."""

    wandb: WandbSpec | None = None
    """Report to Weights & Biases."""
    mlflow: MLflowSpec | None = None
    """Report to MLflow."""

    def secret_env(self) -> dict[str, SecretKeyRef]:
        """Each credential the trackers read, by the environment variable it is read from."""
        wandb, mlflow = self.wandb, self.mlflow
        refs = {
            contract.WANDB_API_KEY_ENV: wandb and wandb.api_key_secret,
            contract.MLFLOW_USERNAME_ENV: mlflow and mlflow.username_secret,
            contract.MLFLOW_PASSWORD_ENV: mlflow and mlflow.password_secret,
            contract.MLFLOW_TOKEN_ENV: mlflow and mlflow.token_secret,
        }
        return {env: ref for env, ref in refs.items() if ref}
