"""The pod contract: what the operator puts into the Ray pods and the trainer reads there.

Every path, environment variable and port that crosses from one half to the other is declared
here once; `rlhf_operator.render` writes them into the RayJob and `rlhf_trainer` reads them.
"""

from __future__ import annotations

from pathlib import PurePosixPath

# The job's ConfigMap: job.yaml is the RLHFJob manifest with defaults applied (`rlhf run` reads it).
JOB_CONFIG_DIR = "/etc/rlhf"
JOB_CONFIG_FILE = "job.yaml"
JOB_CONFIG_PATH = f"{JOB_CONFIG_DIR}/{JOB_CONFIG_FILE}"
# <source name>/ holds the files of a function reward source's ConfigMap.
REWARD_FUNCTIONS_DIR = f"{JOB_CONFIG_DIR}/rewards"
# ... and this one the files of the environment's ConfigMap (spec.environment.function.configMap).
ENVIRONMENT_CODE_DIR = f"{JOB_CONFIG_DIR}/environment"
# models.<field>.pvc is mounted (at its subPath) on MODELS_DIR/<field>; models.<field>.path is inside it.
MODELS_DIR = "/mnt/models"
# resources.modelCache's claim is mounted here on every Ray pod, with HF_HOME_ENV pointing at it: huggingface_hub
# (transformers, vLLM) and datasets keep their caches under HF_HOME, so hub downloads land on the claim.
MODEL_CACHE_DIR = "/mnt/hf-cache"
HF_HOME_ENV = "HF_HOME"

# The trainer image's user and group (trainer_image/Dockerfile: useradd --uid 1000): every pod runs
# as them, its volumes group-owned by it (fsGroup), so that the user can write a root-owned claim.
TRAINER_UID = 1000
# The pod network's interface in every CNI's pods: the GPU workers' NCCL and Gloo sockets use it.
POD_INTERFACE = "eth0"
# The labels and annotations the operator sets on the Ray pods (rlhf_operator.names and render: it finds a job's
# pods by them, Kueue reads its topology request from them): resources.podLabels and podAnnotations may not set
# them, which admission refuses.
OPERATOR_POD_LABELS = ("app.kubernetes.io/managed-by", "rlhf.dev/job", "rlhf.dev/role")
OPERATOR_POD_ANNOTATIONS = ("rlhf.dev/job-name", "kueue.x-k8s.io/podset-required-topology",
                            "kueue.x-k8s.io/podset-preferred-topology")
# Set on GPU workers of a job with resources.rdma (the adapters NCCL uses); the ranks then check that
# they may lock the memory NCCL registers with those adapters (rlhf_trainer.node_checks), and warn if not...
RDMA_ADAPTERS_ENV = "NCCL_IB_HCA"
# ... unless this is "true" (resources.rdma.requireLockedMemory): then they fail (NODE_UNUSABLE).
REQUIRE_LOCKED_MEMORY_ENV = "RLHF_REQUIRE_LOCKED_MEMORY"

# Who the job is: the trainer patches this RLHFJob's status.
# The one condition of status.conditions the trainer writes (rlhf_trainer/learning_signal.py); the chart's
# trainer-status policy lets it change that one and no other.
TRAINER_CONDITION = "Stalled"
NO_LEARNING_SIGNAL, LEARNING_SIGNAL = "NoLearningSignal", "LearningSignal"  # its reasons when True, False
JOB_NAME_ENV = "RLHF_JOB_NAME"
JOB_NAMESPACE_ENV = "RLHF_JOB_NAMESPACE"
# The trainer's Prometheus endpoint on the head pod, exposed as the container port METRICS_PORT_NAME.
METRICS_PORT_ENV = "RLHF_METRICS_PORT"
METRICS_PORT = 9400
METRICS_PORT_NAME = "metrics"
# The labels naming the RLHFJob on every per-job series, the trainer's and the operator's, so alerts
# join the two (not `namespace`: Prometheus sets that to the scraped pod's own).
METRIC_JOB_LABELS = ("rlhf_job", "rlhf_namespace")
# Under checkpoint.path: metrics.jsonl, tensorboard/ and the trackers' local files (`rlhf tensorboard` reads them).
LOGS_DIR = "logs"
# spec.tracking's credentials, set from their Secrets by reference under the names the W&B and
# MLflow clients read themselves (the trainer never handles the values).
WANDB_API_KEY_ENV = "WANDB_API_KEY"
MLFLOW_USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
MLFLOW_PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
MLFLOW_TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
# Seconds a Ray pod has between its deletion (the job deleted, preempted or suspended) and SIGKILL
# (terminationGracePeriodSeconds): the driver finishes the step under way and saves a checkpoint of
# it in that time, so it must exceed a step plus a save.
TERMINATION_GRACE_SECONDS = 300
# The driver writes its process id to the file this variable names (set on the head): the head's
# preStop hook sends it SIGTERM through that file.
DRIVER_PID_FILE_ENV = "RLHF_DRIVER_PID_FILE"
DRIVER_PID_FILE = "/tmp/rlhf-driver.pid"
# The trainer's last stderr line when a run fails is "<job file>: RUN_FAILED<Error>: <what>"; the
# operator finds it in the log tail KubeRay quotes (Ray's job supervisor keeps the last 10 lines, so
# the trainer prints it after its teardown) and makes it the job's failure message.
RUN_FAILED = "the run failed: "
# A failure whose <Error> is one of these is the job's status reason (KubeRay's is AppFailed for any).
NODE_UNUSABLE = "NodeUnusable"  # a GPU rank's node cannot run it (rlhf_trainer.node_checks.NodeUnusable)
WRONG_IMAGE_DEVICE = "WrongImageDevice"  # the image's vLLM is built for another device (node_checks)
FAILURE_REASONS = (NODE_UNUSABLE, WRONG_IMAGE_DEVICE)


def reward_token_env(source_name: str) -> str:
    """The variable holding an http reward source's bearer token (set from its Secret by reference)."""
    return f"RLHF_REWARD_{source_name.upper().replace('-', '_')}_TOKEN"


def model_mount(field: str) -> str:
    """Where the PVC of spec.models.<field> is mounted in every Ray pod."""
    return f"{MODELS_DIR}/{field}"


def model_on_pvc(field: str, path: str) -> str:
    """The directory of a model whose spec.models.<field>.path lies on its PVC."""
    return str(PurePosixPath(model_mount(field)) / path.lstrip("/"))
