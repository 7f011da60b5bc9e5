"""The two images, built from their Dockerfiles (e2e/images), started as a cluster starts them."""

from __future__ import annotations

from e2e import images


def podman_run(*args: str) -> str:
    """stdout of `podman run [OPTIONS] IMAGE [ARGS]`: a container of a local image with the image's
    user, entrypoint and env, without a network."""
    return images.run("podman", "run", "--rm", "--pull=never", "--network", "none", *args).stdout


def test_trainer_image_runs_as_1000_and_imports_the_stack(trainer_image: str):
    out = podman_run(trainer_image, "python", "-c",
                     "import os, deepspeed, ray, rlhf_trainer, torch, vllm;"
                     "print('user', os.getuid(), os.getgid(), os.access(os.environ['HOME'], os.W_OK))")
    assert "user 1000 1000 True" in out.splitlines()


def test_trainer_image_has_deepspeed_ops_prebuilt_and_no_compiler(trainer_image: str):
    """The op the CPU image uses (the shared-memory collective; the optimizer is torch's AdamW,
    tests/trainer/test_optimizer.py) is in it: without a compiler a JIT build would fail."""
    out = podman_run(trainer_image, "python", "-c",
                     "import shutil; from deepspeed.ops.op_builder import ShareMemCommBuilder;"
                     "ShareMemCommBuilder().load(verbose=False);"
                     "print('compiler', shutil.which('c++'))")
    assert "compiler None" in out.splitlines()


def test_operator_image_entrypoint_runs_as_10001(operator_image: str):
    assert images.config(operator_image)["User"] == "10001"
    assert "usage" in podman_run(operator_image, "--help").lower()  # appended to ENTRYPOINT rlhf operator
    assert podman_run("--entrypoint", "id", operator_image, "-u") == "10001\n"


def test_images_leave_gpu_visibility_to_the_device_plugin(operator_image: str, trainer_image: str):
    """NVIDIA_VISIBLE_DEVICES=all in an image shows every GPU of a node whose default runtime is
    nvidia to the pod, the CPU-only Ray head among them; the device plugin sets it for GPU pods."""
    for image in (operator_image, trainer_image):
        assert not [var for var in images.config(image)["Env"] if var.startswith("NVIDIA_VISIBLE_DEVICES=")], image


def test_trainer_user_1000_is_made_on_a_base_that_has_one(base_image: str):
    """Ubuntu 24.04 images, every nvidia/cuda:*-ubuntu24.04 among them, have the user `ubuntu`
    with uid 1000: the trainer Dockerfile's user steps, run on a base with such a user, still make
    its user 1000 (group 1000, as the pod runtime's fsGroup handling assumes)."""
    user_steps = [line.removeprefix("RUN ") for line in images.instructions(images.TRAINER_CPU.dockerfile)
                  if line.startswith("RUN ") and "useradd" in line]
    script = "\n".join(["useradd --uid 1000 --create-home ubuntu", *user_steps, "id 1000"])
    assert "uid=1000(ray) gid=1000(ray)" in podman_run(base_image, "sh", "-ec", script)


def test_a_login_shell_in_the_trainer_image_finds_ray_and_rlhf(trainer_image: str):
    """KubeRay runs each Ray container's command in `bash -lc`, and Debian's /etc/profile resets PATH:
    without the image's own profile script, `ray start` is not found in the head pod."""
    out = podman_run(trainer_image, "bash", "-lc", "command -v ray rlhf")
    assert out.split() == ["/opt/venv/bin/ray", "/opt/venv/bin/rlhf"]
