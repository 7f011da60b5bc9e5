"""pytest fixtures for tests on the real local control plane (register with
``pytest_plugins = ["e2e.fixtures"]`` in the root conftest.py).

- ``control_plane`` (session): etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
  with the repo's crds/ and KubeRay's CRDs installed. Builds missing binaries first.
- ``kwok_nodes`` (session): starts kwok on that control plane and creates the fake GPU/CPU
  nodes of e2e/kwok/nodes.yaml; returns their names.
- ``kuberay_operator`` (session): starts the real KubeRay operator (and kwok, so its pods run).
- ``pod_runtime`` (module): the kubelet of a Node this machine plays (e2e/pods/kubelet.py), with
  KubeRay running: the pods that select and tolerate it run for real (head, workers, submitter).
  The Node goes with the module, so other modules see only kwok's nodes.
- ``kueue`` (module): starts Kueue (with KubeRay and kwok) for one test module, stops it after.
- ``kueue_queues``: make(gpus) creates ResourceFlavors over the kwok nodes, a ClusterQueue with
  that GPU quota and a LocalQueue in the test's namespace; returns the LocalQueue's name.
- ``kube_api``: typed clients (core, apps, batch, rbac, custom objects, apiextensions).
- ``kubeconfig``: the kubeconfig path, also exported as KUBECONFIG for the session.
- ``namespace``: a fresh namespace per test (with its default ServiceAccount), deleted after.
- ``operator_image``, ``trainer_image`` (session): the names of the images built from
  operator/Dockerfile and trainer_image/Dockerfile (DEVICE=cpu) by e2e/images, which start building
  at collection, beside the tests that need neither; ``base_image``: their FROM image.

Environment: RLHF_CACHE (where binaries, etcd seeds and run dirs live; default
~/.cache/rlhf-operator), RLHF_E2E_KEEP=1 keeps the run dir (logs, etcd data) even when every
test passed (it is always kept after a failure), RLHF_E2E_NO_SEED=1 installs the CRDs into a
fresh etcd instead of starting from the cached seed.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e import hub, images
from e2e.controlplane import BUILD_TARGETS, Binaries, ControlPlane
from e2e.controlplane import queues as kueue_objects

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny random causal LM (rlhf_trainer/tiny.py), built offline once per worker: what most training tests run."""
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, converted offline once per content (e2e/hub.py). The tests that take it are one
    unit of work (e2e/parallel.py SHARED_FIXTURES): a run that trains the real model holds GiBs (its model groups
    and vLLM), two at once do not fit beside the rest of the suite on this machine."""
    return hub.smollm2()


def example_jobs() -> list[Path]:
    """The example RLHFJobs every check reads: manifests/examples/*.yaml and the pipeline's stages."""
    examples = Path(__file__).resolve().parents[1] / "manifests" / "examples"
    return sorted(p for pattern in ("*.yaml", "pipeline/*.yaml") for p in examples.glob(pattern)
                  if not p.name.startswith("."))


_STARTED: list[ControlPlane] = []
_built: concurrent.futures.Future | None = None  # the control plane's build, when it runs beside the first tests
_images_built: concurrent.futures.Future | None = None  # the images' build, likewise
_IMAGE_FIXTURES = {"base_image", "operator_image", "trainer_image"}
_image_log: list[str] = []  # what the images' build did (reported at the end, never asserted)
NEEDS_BUILD = "needs_build"  # the marker of tests that run binaries of e2e/build/build.sh without the control plane


@dataclass
class KubeAPI:
    """Clients sharing one ApiClient configured for the test control plane."""

    api_client: object
    core: object
    apps: object
    batch: object
    rbac: object
    custom: object
    apiextensions: object


def _failed(session: pytest.Session) -> bool:
    return bool(session.testsfailed) or os.environ.get("RLHF_E2E_KEEP") == "1"


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    if _built is not None:
        _built.result()  # the build started at collection; its errors surface here
    cp = ControlPlane(controller_manager=True, scheduler=True, kwok=False, kuberay=False)
    cp.start()
    _STARTED.append(cp)
    try:
        yield cp
    finally:
        keep = _failed(request.session)
        if keep:
            cp.dump_logs(lines=20)
        cp.stop(keep_state=keep)


@pytest.fixture(scope="session")
def kwok_nodes(control_plane: ControlPlane) -> list[str]:
    """Names of the fake nodes (two tainted GPU nodes, one CPU node), all Ready."""
    return control_plane.start_kwok()


@pytest.fixture(scope="session")
def kuberay_operator(control_plane: ControlPlane, kwok_nodes: list[str]) -> ControlPlane:
    control_plane.start_kuberay()
    return control_plane


@pytest.fixture(scope="module")
def pod_runtime(kuberay_operator: ControlPlane, base_image: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """base_image: the image store its containers come from, set up (e2e/pods/rootfs.py)."""
    from e2e.pods.kubelet import Kubelet

    cp = kuberay_operator
    kubelet = Kubelet(cp.api_client(), cp.ports["kube-apiserver"], cp.pki / "ca.crt",
                      tmp_path_factory.mktemp("kubelet"), cp.hosts_file).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@pytest.fixture(scope="module")
def kueue(kuberay_operator: ControlPlane) -> Iterator[ControlPlane]:
    """Kueue (framework ray.io/rayjob) for this module's tests, stopped after them: Kueue acts on
    every RayJob with a queue label, and other modules label RayJobs while playing Kueue's part
    themselves."""
    kuberay_operator.start_kueue()
    try:
        yield kuberay_operator
    finally:
        # Kueue releases the finalizers of the Workloads of deleted jobs; without it their
        # namespaces would never go.
        try:
            wait_for(lambda: not kuberay_operator.api.get_json(
                f"/apis/{kueue_objects.API}/workloads")[1]["items"], 60, "Workloads to be deleted")
        except AssertionError as e:
            warnings.warn(str(e), stacklevel=1)
        kuberay_operator.stop_kueue()


@pytest.fixture
def kueue_queues(kueue: ControlPlane,
                 namespace: str) -> Iterator[Callable[[Mapping[str, int]], str]]:
    """make({gpu product: count}) -> a LocalQueue in the test's namespace whose ClusterQueue has
    that many GPUs of each product (no others), on ResourceFlavors of the kwok nodes."""
    made: list[tuple[str, str]] = []

    def make(gpus: Mapping[str, int]) -> str:
        # The LocalQueue's name becomes a label value (at most 63 characters); the ClusterQueue
        # is cluster-wide, so it is named after the namespace.
        local, cluster = f"queue-{len(made)}", f"{namespace}-{len(made)}"
        kueue_objects.create_queues(kueue.api, namespace, local, cluster, gpus)
        made.append((local, cluster))
        return local

    yield make
    for local, cluster in made:
        kueue_objects.delete_queues(kueue.api, namespace, local, cluster)


def _built_images() -> None:
    """Wait for the build started at collection. A failed one is reported and left to the fixture's own
    build to try again (a download that failed once; the fixture's build raises if it fails too)."""
    if _images_built is not None and (error := _images_built.exception()) is not None:
        _image_log.append(f"the images' first build failed ({type(error).__name__}: {error}); building again")


@pytest.fixture(scope="session")
def base_image() -> str:
    _built_images()
    return images.base(_image_log.append)


@pytest.fixture(scope="session")
def operator_image() -> str:
    _built_images()
    return images.build(images.OPERATOR, _image_log.append)


@pytest.fixture(scope="session")
def trainer_image() -> str:
    _built_images()
    return images.build(images.TRAINER_CPU, _image_log.append)


@pytest.fixture(scope="session")
def kubeconfig(control_plane: ControlPlane) -> Iterator[str]:
    path = str(control_plane.kubeconfig)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", path)
        yield path


@pytest.fixture(scope="session")
def kube_api(control_plane: ControlPlane) -> Iterator[KubeAPI]:
    from kubernetes import client

    api_client = control_plane.api_client()
    try:
        yield KubeAPI(
            api_client=api_client,
            core=client.CoreV1Api(api_client),
            apps=client.AppsV1Api(api_client),
            batch=client.BatchV1Api(api_client),
            rbac=client.RbacAuthorizationV1Api(api_client),
            custom=client.CustomObjectsApi(api_client),
            apiextensions=client.ApiextensionsV1Api(api_client),
        )
    finally:
        api_client.close()


def answers(url: str) -> bool:
    """Whether an HTTP endpoint answers 200 now (a server being started, a health check)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_for(cond, timeout: float = 30.0, what: str = "condition", interval: float = 0.1, max_interval: float = 1.0):
    """Poll cond() until it returns something truthy; return that value. The polling interval grows from
    interval to max_interval."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
        interval = min(interval * 1.5, max_interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@pytest.fixture
def namespace(kube_api: KubeAPI, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace whose default ServiceAccount exists (so pods can be created)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    base = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{base}-{uuid.uuid4().hex[:6]}"
    kube_api.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"rlhf.dev/e2e": "true"})))

    def has_default_sa() -> bool:
        try:
            kube_api.core.read_namespaced_service_account("default", name)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    wait_for(has_default_sa, 30, f"ServiceAccount {name}/default")
    yield name
    try:
        kube_api.core.delete_namespace(name)
    except ApiException as e:
        if e.status != 404:
            raise
    # The namespace itself may linger (finalizers of other controllers); its pods must not,
    # or they would hold fake GPUs that the next test schedules onto.
    try:
        wait_for(lambda: not kube_api.core.list_namespaced_pod(name).items, 30,
                 f"pods of namespace {name} to be deleted")
    except AssertionError as e:
        warnings.warn(str(e), stacklevel=1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{NEEDS_BUILD}: runs binaries e2e/build/build.sh builds (helm, promtool ...); "
                            "ordered after the tests that need no build, and waits for it outside its timeout")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build missing control-plane binaries before the first test that needs them: a first build
    takes many minutes and must not count against a test's timeout."""
    if session.config.option.collectonly:
        return
    if any(needs_images(item) for item in session.items):
        _start_images_build()
    if not any(needs_build(item) for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def log(msg: str) -> None:
        if reporter is not None:
            reporter.write_line(f"[e2e build] {msg}")

    if needs_build(session.items[0]):
        Binaries.default().ensure(BUILD_TARGETS, log)
        return
    # The tests before the first that needs it (the unit and ML tests) run while it builds, so a
    # fresh machine's run is shorter by the build's time; pytest_runtest_protocol waits for it.
    global _built
    ahead = next(i for i, item in enumerate(session.items) if needs_build(item))
    log(f"building the control plane (if needed) while the {ahead} tests before the first that needs it run")
    builder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-build")
    _built = builder.submit(Binaries.default().ensure, BUILD_TARGETS, lambda msg: None)
    builder.shutdown(wait=False)


def _start_images_build() -> None:
    """Both images build in a thread, beside the tests that need neither them nor the control plane
    (their pip steps mostly wait on downloads; a cold build takes many minutes, outside any test's
    timeout). pytest_runtest_protocol waits for it before the first test that needs an image."""
    global _images_built

    def build_both() -> None:
        images.build(images.OPERATOR, _image_log.append)
        images.build(images.TRAINER_CPU, _image_log.append)

    builder = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="e2e-images")
    _images_built = builder.submit(build_both)
    builder.shutdown(wait=False)


def needs_images(item: pytest.Item) -> bool:
    return bool(_IMAGE_FIXTURES & set(getattr(item, "fixturenames", ())))


def builds_current() -> bool:
    """Every binary of the control plane there and both images built (if not from this checkout: a change
    to the sources rebuilds only the images' last layers, in about a minute): a warm machine, where no
    test waits long for a build."""
    binaries = Binaries.default()
    if not all(path.exists() for target in BUILD_TARGETS for path in binaries.outputs(target)):
        return False
    try:
        return all(images.image_id(image.name) for image in (images.OPERATOR, images.TRAINER_CPU))
    except (OSError, subprocess.SubprocessError):  # no buildah yet
        return False


def needs_build(item: pytest.Item) -> bool:
    """The test uses the control plane, or a binary of build.sh (marked NEEDS_BUILD)."""
    return "control_plane" in getattr(item, "fixturenames", ()) or item.get_closest_marker(NEEDS_BUILD) is not None


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Wait for a build still running before the first test that needs it, outside that test's
    timeout (pytest-timeout's own wrapper starts the clock inside this one)."""
    for build, needed, line in ((_built, needs_build, "[e2e build] waiting for the control plane's build"),
                                (_images_built, needs_images, "[e2e images] waiting for the images' build")):
        if build is not None and not build.done() and needed(item):
            reporter = item.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(line)
            concurrent.futures.wait([build])
    yield


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Report how long the control plane took to come up and what the images' build did (measured,
    never asserted)."""
    for line in _image_log:
        terminalreporter.write_line(f"[e2e images] {line}")
    for cp in _STARTED:
        t = cp.timings
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in t.items() if k != "start_total")
        terminalreporter.write_line(
            f"control plane (Kubernetes {cp.versions['KUBERNETES_VERSION']}, etcd "
            f"{cp.versions['ETCD_VERSION']}): start {t.get('start_total', 0):.2f}s [{parts}]")
