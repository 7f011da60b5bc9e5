"""Operator chaos: many job lifecycles with random user actions, RayJob transitions and SIGKILLs.

Each wave creates JOBS_PER_WAVE jobs in a burst, then makes random moves: suspend, resume, an edit
of the fields that may change (backoffLimit, startupDeadlineSeconds), delete, and KubeRay's part
(RayJob status transitions written as KubeRay writes them, e2e/operator/kuberay.py). Between any
two moves the operator may be SIGKILLed, wherever it is in its work (not only at the crash seams
of test_operator_crash.py), and restarted at once or only a few moves later, so that some moves
happen while no operator runs. Then the invariants are checked with the operator running:

- every job has exactly one ConfigMap, ServiceAccount, Role, RoleBinding and RayJob, owned by it;
- the RayJob carries the job's suspend flag and lifecycle fields (unless the run has ended);
- every job reaches the phase and reason its history implies (none stuck);
- deleted jobs are gone with their children, and no child is left without its job.

Finally the wave's jobs are all deleted, with more kills. The seed is printed (RLHF_CHAOS_SEED
replays a run); the last line is the summary docs/concepts/reliability.md quotes.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from dataclasses import dataclass

from e2e.fixtures import wait_for
from e2e.operator.jobs import children, create_job, get_job, rlhf_job
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import v1alpha1 as api
from rlhf_operator import names

WAVES, JOBS_PER_WAVE, MOVES_PER_WAVE = 3, 20, 60
KILL_CHANCE = 0.06  # per create, move and delete: five or six kills a wave
SETTLE_SECONDS = 60  # for the operator to converge after its last restart (2 busy cores)
KINDS = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob")
JOB_LABEL = "rlhf.dev/job"

# The RayJob status KubeRay would write next, while the job is neither suspended nor ended.
NEXT_RAY = {"new": ("initializing",), "initializing": ("running",), "running": ("succeeded", "failed")}
# (phase, reason) of a job at rest, by the last RayJob status the test wrote.
EXPECTED = {
    "new": ("Pending", "RayJobCreated"),
    "initializing": ("Provisioning", "StartingRayCluster"),
    "running": ("Running", "Training"),
    "succeeded": ("Succeeded", "Completed"),
    "failed": ("Failed", "AppFailed"),
    "suspended": ("Suspended", "Suspended"),
}


@dataclass
class Job:
    """What the test did to one job: the truth its status is checked against."""

    name: str
    uid: str
    suspend: bool = False
    backoff_limit: int = 0
    startup_deadline: int | None = None
    ray: str = "new"  # the RayJob status last written (as KubeRay)
    deleted: bool = False

    @property
    def ended(self) -> bool:
        return self.ray in ("succeeded", "failed")

    def ray_fields(self) -> dict:
        return {"suspend": self.suspend, "backoffLimit": self.backoff_limit,
                "preRunningDeadlineSeconds": self.startup_deadline}


class Chaos:
    def __init__(self, kube, namespace: str, operator, rng: random.Random):
        self.kube, self.namespace, self.operator, self.rng = kube, namespace, operator, rng
        self.jobs: list[Job] = []
        self.counts: Counter[str] = Counter()
        self.restart_in: int | None = None  # moves until a killed operator is started again
        self.violations: list[str] = []

    # --------------------------------------------------------------------------- the operator
    def maybe_kill(self) -> None:
        if self.restart_in is not None:
            self.restart_in -= 1
            if self.restart_in <= 0:
                self.restart()
            return
        if self.rng.random() < KILL_CHANCE:
            time.sleep(self.rng.uniform(0, 0.5))  # somewhere inside whatever it is doing now
            self.operator.kill()
            self.counts["kills"] += 1
            self.restart_in = self.rng.choice([0, 0, 1, 3, 5])
            if self.restart_in == 0:
                self.restart()

    def restart(self) -> None:
        if self.operator.proc is None or self.operator.proc.poll() is not None:
            self.operator.start()
            self.counts["restarts"] += 1
        self.restart_in = None

    # --------------------------------------------------------------------------- moves
    def live(self) -> list[Job]:
        return [job for job in self.jobs if not job.deleted]

    def create(self, name: str) -> None:
        created = create_job(self.kube, self.namespace, rlhf_job(name))
        self.jobs.append(Job(name, created["metadata"]["uid"]))
        self.counts["lifecycles"] += 1

    def move(self) -> None:
        live = self.live()
        if not live:
            return
        job = self.rng.choice(live)
        kind = self.rng.choices(list(MOVES), weights=[w for w, _ in MOVES.values()])[0]
        if MOVES[kind][1](self, job):
            self.counts[kind] += 1

    def suspend(self, job: Job) -> bool:
        return self._set_suspend(job, True)

    def resume(self, job: Job) -> bool:
        return self._set_suspend(job, False)

    def _set_suspend(self, job: Job, suspend: bool) -> bool:
        if job.suspend == suspend:
            return False
        self.kube.patch(api.KIND, self.namespace, job.name, {"spec": {"suspend": suspend}})
        job.suspend = suspend
        return True

    def edit(self, job: Job) -> bool:
        job.backoff_limit = self.rng.randint(0, 3)
        job.startup_deadline = self.rng.choice([None, 600, 1800])
        self.kube.patch(api.KIND, self.namespace, job.name, {"spec": {
            "backoffLimit": job.backoff_limit, "startupDeadlineSeconds": job.startup_deadline}})
        return True

    def delete(self, job: Job) -> bool:
        self.kube.delete(api.KIND, self.namespace, job.name, job.uid)
        job.deleted = True
        return True

    def kuberay(self, job: Job) -> bool:
        """KubeRay's next step for this RayJob, if KubeRay would take one now: it acts on the RayJob's
        spec, so nothing happens until the operator has carried the job's suspend flag over."""
        ray_job = self.kube.get("RayJob", self.namespace, names.ray_job(job.name))
        if ray_job is None or job.ended or ray_job["spec"].get("suspend", False) != job.suspend:
            return False
        status = RayJobStatus(self.kube, self.namespace, ray_job["metadata"]["name"])
        if job.suspend:
            if job.ray == "suspended":
                return False
            status.suspending()
            status.suspended()
            job.ray = "suspended"
        elif job.ray == "suspended":
            status.new()
            job.ray = "new"
        else:
            job.ray = self.rng.choice(NEXT_RAY[job.ray])
            if job.ray == "failed":
                status.failed("AppFailed", "Job entrypoint command failed with exit code 1")
            else:
                getattr(status, job.ray)()
        return True

    # --------------------------------------------------------------------------- invariants
    def settle(self) -> None:
        """Operator up; KubeRay finishes what it would do on its own (suspend, restart after a resume)."""
        self.restart()
        for job in self.live():
            if job.ended:
                continue
            self.wait(lambda j=job: self.ray_spec_matches(j), f"{job.name}: its RayJob to carry "
                      f"{job.ray_fields()}")
            if (job.suspend and job.ray != "suspended") or (not job.suspend and job.ray == "suspended"):
                self.kuberay(job)

    def ray_spec_matches(self, job: Job) -> bool:
        ray_job = self.kube.get("RayJob", self.namespace, names.ray_job(job.name))
        if ray_job is None:
            return False
        spec = ray_job["spec"]
        return {key: spec.get(key, False if key == "suspend" else None) for key in job.ray_fields()} == job.ray_fields()

    def check(self, wave: int) -> None:
        for job in self.live():
            expected = EXPECTED["suspended" if job.suspend and not job.ended else job.ray]
            self.wait(lambda j=job, e=expected: self.phase(j) == e,
                      f"{job.name} (suspend {job.suspend}, RayJob {job.ray}) to be {expected}")
            found = children(self.kube, self.namespace, job.name)
            counts = {kind: len(objs) for kind, objs in found.items()}
            if counts != dict.fromkeys(KINDS, 1):
                self.violations.append(f"wave {wave}: {job.name} has children {counts}, not one of each")
            for kind, objs in found.items():
                for obj in objs:
                    owners = [ref["uid"] for ref in obj["metadata"].get("ownerReferences") or []]
                    if owners != [job.uid]:
                        self.violations.append(f"wave {wave}: {kind} {obj['metadata']['name']} is owned by "
                                               f"{owners}, not by {job.name} ({job.uid})")
        for job in self.jobs:
            if job.deleted:
                self.wait(lambda j=job: self.kube.get(api.KIND, self.namespace, j.name) is None,
                          f"deleted {job.name} to be gone (its finalizer released)")
        self.wait(self.no_orphans, "children of deleted jobs to be collected")

    def phase(self, job: Job) -> tuple[str | None, str | None]:
        status = get_job(self.kube, self.namespace, job.name).get("status") or {}
        return status.get("phase"), status.get("reason")

    def no_orphans(self) -> bool:
        return not self.orphans()

    def orphans(self) -> list[str]:
        """Children whose job is not one of the live ones (the garbage collector has yet to delete them)."""
        live = {job.uid for job in self.live()}
        return [f"{kind} {obj['metadata']['name']}" for kind in KINDS
                for obj in self.kube.list(kind, self.namespace, JOB_LABEL)
                if not {ref["uid"] for ref in obj["metadata"].get("ownerReferences") or []} & live]

    def wait(self, condition, what: str) -> None:
        try:
            wait_for(condition, SETTLE_SECONDS, what)
        except AssertionError as error:
            extra = f"; orphans: {self.orphans()}" if condition == self.no_orphans else ""
            self.violations.append(f"{error}{extra}")


MOVES = {  # move -> (weight, what it does)
    "suspend": (2, Chaos.suspend),
    "resume": (2, Chaos.resume),
    "edit": (2, Chaos.edit),
    "delete": (1, Chaos.delete),
    "kuberay": (6, Chaos.kuberay),
}


def test_operator_kills_during_random_lifecycles(kube, namespace, operator, kuberay_paused):
    seed = int(os.environ.get("RLHF_CHAOS_SEED") or random.SystemRandom().randrange(2**31))
    print(f"\noperator chaos seed {seed} (RLHF_CHAOS_SEED={seed} replays it)")
    chaos = Chaos(kube, namespace, operator, random.Random(seed))
    operator.start()
    for wave in range(WAVES):
        for index in range(JOBS_PER_WAVE):
            chaos.create(f"w{wave}-job-{index}")
            chaos.maybe_kill()
        for _ in range(MOVES_PER_WAVE):
            chaos.move()
            chaos.maybe_kill()
            time.sleep(chaos.rng.uniform(0, 0.2))
        chaos.settle()
        chaos.check(wave)
        assert not chaos.violations, f"seed {seed}, wave {wave}:\n" + "\n".join(chaos.violations)
        # End of the wave's lifecycles: everything deleted, with kills in between.
        for job in chaos.live():
            chaos.delete(job)
            chaos.maybe_kill()
        chaos.restart()
        chaos.check(wave)
        assert not chaos.violations, f"seed {seed}, wave {wave} deletion:\n" + "\n".join(chaos.violations)

    c = chaos.counts
    moves = sum(c[kind] for kind in MOVES)
    print(f"operator chaos (seed {seed}): {c['lifecycles']} job lifecycles, {moves} moves "
          f"({', '.join(f'{c[kind]} {kind}' for kind in MOVES)}), {c['kills']} SIGKILLs of the operator, "
          f"{c['restarts']} restarts; 0 duplicate children, 0 orphans, 0 jobs stuck, 0 wrong final statuses")
    assert c["lifecycles"] >= WAVES * JOBS_PER_WAVE and c["kills"] > 0
