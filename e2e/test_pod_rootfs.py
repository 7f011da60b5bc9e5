"""A container's filesystem and command as the pod runtime takes them from an image (e2e/pods/rootfs.py)."""

import json

import pytest

from e2e.pods import rootfs, users
from rlhf_trainer.workers.vllm_model_info import ARCHITECTURES

IMAGE = rootfs.ImageConfig(user="1000", env={"PATH": "/opt/venv/bin:/usr/bin"}, workdir="/home/ray",
                           entrypoint=["tini", "--"], cmd=["python3"])


@pytest.mark.parametrize("container, argv", [
    ({}, ["tini", "--", "python3"]),
    ({"args": ["-c", "pass"]}, ["tini", "--", "-c", "pass"]),  # args replace the Cmd only
    ({"command": ["ray", "start"]}, ["ray", "start"]),  # command drops the Entrypoint and the Cmd
    ({"command": ["bash", "-lc"], "args": ["ray start"]}, ["bash", "-lc", "ray start"]),
])
def test_command_and_args_merge_with_the_image_s_entrypoint_and_cmd_as_the_kubelet_merges_them(container, argv):
    assert rootfs.command(container, IMAGE) == argv


def test_the_pod_s_security_context_wins_over_the_image_s_user():
    assert users.identity({}, {}, (1000, 1000))[:2] == (1000, 1000)
    assert users.identity({"securityContext": {"runAsUser": 2000, "fsGroup": 3000}}, {}, (1000, 1000)).groups == (0, 3000)
    with pytest.raises(PermissionError, match="runAsNonRoot"):
        users.identity({"securityContext": {"runAsNonRoot": True}}, {}, (0, 0))  # an image that runs as root


def test_a_container_of_the_trainer_image_is_its_user_home_and_env(trainer_image):
    layer = rootfs.Rootfs(trainer_image, "e2e-rootfs-test")
    try:
        assert layer.user(layer.config.user) == (1000, 1000) == layer.user("ray")
        assert layer.home(1000) == "/home/ray" and (layer.path / "opt/venv/bin/ray").exists()
        assert layer.config.env["PATH"].startswith("/opt/venv/bin:") and layer.config.workdir == "/home/ray"
        check_vllm_model_info_cached(layer)
        (layer.path / "written").write_text("")  # its own writable layer ...
    finally:
        layer.remove()
    again = rootfs.Rootfs(trainer_image, "e2e-rootfs-test")
    try:
        assert not (again.path / "written").exists()  # ... which the next container does not see
    finally:
        again.remove()


def check_vllm_model_info_cached(layer: rootfs.Rootfs) -> None:
    """The image's user has vLLM's model info for the examples' architectures in its cache, each entry keyed by the
    hash vLLM takes of the image's own module file: an engine in a pod reads it instead of inspecting the class
    in a child process (every pod's engine did: about 12 CPU-seconds on this machine)."""
    from vllm.model_executor.models.registry import ModelRegistry

    cache = layer.path / "home/ray/.cache/vllm/modelinfos"
    site_packages = layer.path / "opt/venv/lib/python3.11/site-packages"
    for architecture in ARCHITECTURES:
        model = ModelRegistry.models[architecture]
        entry = cache / model._get_cache_filename()
        module = site_packages / (model.module_name.replace(".", "/") + ".py")
        assert json.loads(entry.read_text())["hash"] == model._get_modelinfo_module_hash(module), architecture
        assert entry.stat().st_uid == 1000  # written as the pods' user, who adds the entries of other architectures


def test_an_image_the_node_lacks_fails_with_err_image_never_pull(base_image):  # buildah set up
    with pytest.raises(rootfs.ImageNotPresent, match='image "localhost/absent:1" is not present') as error:
        rootfs.Rootfs("localhost/absent:1", "e2e-rootfs-absent")
    assert error.value.reason == "ErrImageNeverPull"


def test_a_mount_target_s_symlinks_resolve_inside_the_container_s_root(tmp_path):
    """Debian's /var/run is a link to /run: followed on this machine, the ServiceAccount token mounted
    at /var/run/secrets/kubernetes.io/serviceaccount landed in this machine's /run, and the trainer
    found no token in its pod."""
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "etc").mkdir()
    (root / "etc" / "alternatives").symlink_to("../run")  # relative
    assert rootfs.inside(root, "/var/run/secrets/token") == root / "run" / "secrets" / "token"
    assert rootfs.inside(root, "/etc/alternatives/x") == root / "run" / "x"
    assert rootfs.inside(root, "/../../etc/hosts") == root / "etc" / "hosts"  # never above the root
