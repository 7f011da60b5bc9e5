"""Every reason the operator itself writes into an RLHFJob's status or Events: what it means, what to do.

The code keeps its literals where it decides (status.py, reconcile.py, checks.py, rlhf_api's job.py);
tests/test_docs.py fails when a literal is missing here or an entry here is set nowhere, and the
docs' Troubleshooting page lists this table. Reasons the operator passes on from KubeRay, Kueue, the
scheduler or the kubelet are theirs: PASSED_ON names where they come from.
"""

from __future__ import annotations

from rlhf_api import contract

from . import pods

# reason: (phase it comes with, what it means, what to do)
REASONS: dict[str, tuple[str, str, str]] = {
    "WaitingForJob": ("Waiting", "a model of the job is another job's (models.<role>.fromJob) and that job has not "
                      "Succeeded yet; the message names each input and its phase; nothing is created meanwhile",
                      "wait: the job starts when its inputs succeed (`rlhf status JOB` shows them)"),
    "InputJobNotFound": ("Failed", "an input job (models.<role>.fromJob) did not exist 10 minutes after this "
                         "job's creation", "create it or fix the name, then re-create this job"),
    "InputJobFailed": ("Failed", "an input job failed; the message quotes its reason", "fix and re-run the "
                       "input job, then re-create this one"),
    "InputJobDeleted": ("Failed", "an input job was deleted (or re-created) before it succeeded",
                        "re-create the input job, then this one"),
    "InputHasNoModel": ("Failed", "the input job succeeded without a model another job can load (no "
                        "checkpoint.pvc, exportHf false, or LoRA adapters not exported merged)",
                        "re-run the input with what the message names"),
    "InputModelMismatch": ("Failed", "the input exports another kind of model than the role loads (an rm job's "
                           "reward model as an actor), or no best checkpoint for fromJob.model: best",
                           "point fromJob at a job of the right algorithm, or ask for model: final"),
    "InputCycle": ("Failed", "the job's inputs name each other's models in a cycle: none could ever start",
                   "make one of the jobs start from a path"),
    "RayJobCreated": ("Pending", "the RayJob exists; KubeRay has not started the Ray cluster yet",
                      "wait; if it stays, check KubeRay's operator log"),
    "Resuming": ("Pending", "spec.suspend went back to false: KubeRay is starting a new Ray cluster",
                 "wait: the run resumes from its newest checkpoint"),
    "KubeRayNotInstalled": ("Pending", "the cluster does not serve RayJobs (ray.io/v1)",
                            "install KubeRay's CRDs and operator: the job starts once they are there"),
    "RayJobNotCreated": ("Pending", "the API server refused the RayJob (400, 403 or 422); the message quotes it",
                         "fix what the message names (an admission webhook, a quota, RBAC); the operator retries"),
    "RewardConfigMapNotFound": ("Pending, then Failed", "a function reward loads its code from a ConfigMap "
                                "that does not exist; waited for up to 10 minutes after the job's creation",
                                "create the ConfigMap the message names; after the wait, delete and re-create the job"),
    "EnvironmentConfigMapNotFound": ("Pending, then Failed", "as RewardConfigMapNotFound, for "
                                     "spec.environment.function.configMap", "create the ConfigMap the message names"),
    "RuntimeNotFound": ("Pending, then Failed", "spec.runtimeRef names a ClusterRLHFRuntime or RLHFRuntime that does "
                        "not exist; waited for up to 10 minutes after the job's creation",
                        "create the runtime or fix the name (`kubectl get clusterrlhfruntimes,rlhfruntimes -A`); "
                        "after the wait, re-create the job"),
    "RuntimeFieldLocked": ("Failed", "the job sets a field its runtime sets for every job and locks "
                           "(spec.locked of the runtime); the message names them",
                           "remove those fields from the job (the runtime's values apply), then re-create it"),
    "RuntimeInvalid": ("Failed", "the job's runtime does not pass this operator's validation (one the API server "
                       "admitted under an older CRD)", "fix the runtime (`rlhf validate` reads runtime files too), "
                       "then re-create the job"),
    "StartingRayCluster": ("Provisioning", "KubeRay is starting the Ray cluster: pods being scheduled and readied",
                           "wait; a pod problem replaces this reason with the scheduler's or kubelet's"),
    "WaitingForSubmission": ("Provisioning", "the Ray cluster is ready; KubeRay has not submitted the job yet",
                             "wait"),
    "SubmittingJob": ("Provisioning", "the training job is submitted and starting", "wait"),
    "Retrying": ("Provisioning", "an attempt failed and KubeRay retries on a new Ray cluster (backoffLimit); "
                 "the message says which attempt and quotes the trainer's failure", "read the failure in the "
                 "message (`rlhf logs JOB`); the run resumes from the newest checkpoint"),
    "UnknownRayJobState": ("Provisioning", "KubeRay reports a jobDeploymentStatus this operator does not know",
                           "check that KubeRay's version is one this operator supports"),
    "Training": ("Running", "the trainer runs on the Ray cluster", "follow it: `rlhf status JOB`, `rlhf logs -f JOB`"),
    "Finishing": ("Running", "the training job ended; KubeRay has not recorded the result yet", "wait"),
    "Suspending": ("Suspended", "spec.suspend is true: KubeRay is releasing the Ray cluster", "wait"),
    "Suspended": ("Suspended", "spec.suspend is true and the Ray cluster is gone",
                  "set spec.suspend to false to resume from the newest checkpoint"),
    "Queued": ("Suspended", "the job waits for Kueue to admit it from its LocalQueue; the message carries "
               "Kueue's reason (e.g. insufficient quota, no topology domain that fits)",
               "check the ClusterQueue's quota and the workloads ahead"),
    "Completed": ("Succeeded", "training finished successfully", "the final model is under checkpoint.path/final"),
    "Stopped": ("Failed", "the training job was stopped before it finished (e.g. `ray job stop`)",
                "re-create the job to continue from the newest checkpoint"),
    "RayJobFailed": ("Failed", "the Ray job failed and KubeRay gave no reason of its own; the message is the "
                     "trainer's failure line, or KubeRay's", "read the message and `rlhf logs JOB`"),
    "RayJobInvalid": ("Failed", "KubeRay rejected the RayJob (ValidationFailed)",
                      "the message quotes KubeRay; report it: the operator rendered a RayJob KubeRay refuses"),
    "InvalidSpec": ("Failed", "the spec fails this operator's validation (one the API server admitted, e.g. "
                    "under an older CRD)", "`rlhf validate` names each field and the fix; re-create the job"),
    "TooManyGPUsPerNode": ("Failed", "resources.gpusPerNode is more than one node of resources.gpuProduct carries",
                           "lower gpusPerNode and raise resources.nodes"),
    "VolumeNotShared": ("Failed", "a claim the job's pods cannot all mount: with several nodes (resources.nodes) "
                        "one only a single node can attach (ReadWriteOnce, ReadWriteOncePod); with one node, "
                        "ReadWriteOncePod (the head and the worker are two pods), or a read-only claim to write",
                        "several nodes: a ReadWriteMany claim (ReadOnlyMany for a model): NFS, CephFS, Filestore, "
                        "EFS, Lustre; one node: ReadWriteOnce will do"),
    "NameConflict": ("Failed", "a child the operator would create (ConfigMap, ServiceAccount, Role, RoleBinding, "
                     "RayJob) already exists and belongs to something else", "delete it, or re-create the job "
                     "under another name"),
    "DeadlineExceeded": ("Failed", "the job ran longer than spec.activeDeadlineSeconds, counted from its start "
                         "across attempts (also KubeRay's own per-attempt deadline)",
                         "raise it and re-create the job to continue from the newest checkpoint"),
    "RayJobGone": ("Succeeded or Failed", "the RayJob is gone and the trainer had reported how the run ended "
                   "(status.progress.result)", "nothing: the end is recorded"),
    "NotFinished": ("any", "the reason of a false Succeeded condition", "nothing"),
    "NoFailure": ("any", "the reason of a false Failed condition", "nothing"),
    "NotSuspended": ("any", "the reason of a false Suspended condition", "nothing"),
    "SpecNoLongerValid": ("Event", "a running job's spec would be refused by this operator version; the job runs "
                          "on", "change what the Event names before you create the next job"),
    "RayJobDeleted": ("Event", "the RayJob was deleted: recreated while the job runs (it resumes from the newest "
                      "checkpoint), not once the job finished", "nothing; delete or suspend the RLHFJob to stop a run"),
    "TTLExpired": ("Event", "ttlSecondsAfterFinished passed: the job and its children are deleted", "nothing"),
}

# Reasons the operator copies from others while the Ray cluster starts, queues or fails: their source.
PASSED_ON: dict[str, str] = {
    "Unschedulable": "the scheduler (a pod's PodScheduled=False: no node with the GPUs, a taint, a missing PVC)",
    "ReplicaFailure": "KubeRay (it could not create a pod)",
    ", ".join(pods.STUCK_CONTAINER_REASONS): "the kubelet (a container that cannot start)",
    "AppFailed, DeadlineExceeded, SubmissionFailed, ...": "KubeRay, when the Ray job failed",
}

# The trainer's reasons: of the one condition it writes (contract.TRAINER_CONDITION, rlhf_trainer/learning_signal.py),
# and the failures the operator makes the job's reason (contract.FAILURE_REASONS).
FROM_THE_TRAINER: dict[str, tuple[str, str, str]] = {
    contract.NODE_UNUSABLE: (
        "Failed", "a GPU rank found at its start, before any model loaded, that its node cannot run it: the NVIDIA "
        "driver is older than the trainer image's CUDA needs (CUDA 13: R580 or newer), the pod sees no GPU, or "
        "(with resources.rdma.requireLockedMemory) it may not lock memory without limit",
        "fix the node as the message says (upgrade the driver, install NVIDIA's device plugin and container "
        "toolkit, LimitMEMLOCK=infinity for the container runtime) or keep the job off it (resources.gpuProduct, "
        "resources.nodeSelector), then re-create the job"),
    contract.WRONG_IMAGE_DEVICE: (
        "Failed", "the driver found at its start that the trainer image's vLLM is the CPU build and the job asks for "
        "GPUs (resources.gpusPerNode > 0)", "use the CUDA trainer image: drop resources.image to let the operator "
        "pick the -cuda tag, or name one, then re-create the job"),
    contract.NO_LEARNING_SIGNAL: (
        f"condition {contract.TRAINER_CONDITION} True", "for several steps in a row every group of samples scored "
        "alike, so every advantage is zero and the policy does not change (the message has the reward statistics)",
        "check the reward function, the task's difficulty for the model, rollout.samplesPerPrompt, "
        "rollout.temperature and rollout.maxNewTokens; the run goes on until you stop it"),
    contract.LEARNING_SIGNAL: (f"condition {contract.TRAINER_CONDITION} False",
                               "a step's rewards differed within a group again", "nothing"),
}
