"""The RLHFJob API, rlhf.dev/v1alpha1: the single source of the CRD, the trainer's config and `rlhf validate`.

Field docstrings become the CRD's descriptions (`kubectl explain rlhfjob.spec.training.kl`).
Cross-field rules are CEL (`x-kubernetes-validations`) attached to the model that owns them, so
the API server, `rlhf validate` and the trainer enforce exactly the same rules.
"""

from __future__ import annotations

from .base import APIModel, API_VERSION, DateTime, GROUP, KIND, PLURAL, Passthrough, Quantity, VERSION, cel, immutable, section
from .models import JobModelRef, LoRASpec, ModelSpec, ModelsSpec, PVCSource
from .reward import FunctionReward, HTTPReward, RewardSource, RewardSpec, SecretKeyRef, StepReward
from .data import DataSpec, DatasetSource, DatasetSpec
from .shaping import DynamicSamplingSpec, LengthShapingSpec
from .environment import EnvironmentClass, EnvironmentHTTP, EnvironmentSpec
from .evaluation import EvalDataset, EvaluationSpec
from .training import DistillationSpec, KLSpec, PreferenceSpec, RejectionSamplingSpec, RolloutSpec, TrainingSpec
from .resources import CheckpointSpec, EnvVar, PodResources, RDMASpec, ResourcesSpec, RoleGPUs, TopologySpec, WorkerResources
from .tracking import MLflowSpec, TrackingSpec, WandbSpec
from .job import (OBJECT_RULES, Algorithm, AttemptUsage, CheckpointStatus, Condition, JobInput, KeepFailedCluster,
                  KeptCluster, Metrics, OutputModel, Phase, PodUsage, Progress, RLHFJob, RLHFJobSpec, RLHFJobStatus,
                  RuntimeStatus, Usage)
from .runtime import RLHFRuntime, RLHFRuntimeSpec, RuntimeRef

__all__ = [
    "APIModel",
    "API_VERSION",
    "DateTime",
    "GROUP",
    "KIND",
    "PLURAL",
    "Passthrough",
    "Quantity",
    "VERSION",
    "cel",
    "immutable",
    "section",
    "JobModelRef",
    "LoRASpec",
    "ModelSpec",
    "ModelsSpec",
    "PVCSource",
    "OBJECT_RULES",
    "JobInput",
    "OutputModel",
    "FunctionReward",
    "HTTPReward",
    "RewardSource",
    "RewardSpec",
    "SecretKeyRef",
    "StepReward",
    "DataSpec",
    "DatasetSource",
    "DatasetSpec",
    "DynamicSamplingSpec",
    "LengthShapingSpec",
    "EnvironmentClass",
    "EnvironmentHTTP",
    "EnvironmentSpec",
    "EvalDataset",
    "EvaluationSpec",
    "DistillationSpec",
    "KLSpec",
    "PreferenceSpec",
    "RejectionSamplingSpec",
    "RolloutSpec",
    "TrainingSpec",
    "CheckpointSpec",
    "EnvVar",
    "PodResources",
    "WorkerResources",
    "RDMASpec",
    "ResourcesSpec",
    "RoleGPUs",
    "TopologySpec",
    "MLflowSpec",
    "TrackingSpec",
    "WandbSpec",
    "Algorithm",
    "CheckpointStatus",
    "Condition",
    "KeepFailedCluster",
    "KeptCluster",
    "Metrics",
    "Phase",
    "Progress",
    "RLHFJob",
    "RLHFJobSpec",
    "RLHFJobStatus",
    "RLHFRuntime",
    "RLHFRuntimeSpec",
    "RuntimeRef",
    "RuntimeStatus",
    "PodUsage",
    "AttemptUsage",
    "Usage",
]
