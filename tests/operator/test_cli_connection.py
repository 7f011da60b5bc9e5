"""`rlhf` where there is no cluster to talk to, or not the half a command needs: one line a person can act on,
exit status 1, no traceback. Run as a user runs it (a process with its own environment)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from rlhf_cli.cli import main

REPO = Path(__file__).resolve().parents[2]
NO_CLUSTER = "set KUBECONFIG, pass --kubeconfig, or run inside a pod\n"


def rlhf(*args: str, home: Path, preamble: str = "", **env: str) -> subprocess.CompletedProcess:
    """`rlhf ARGS` with HOME=home (no ~/.kube/config), outside any pod, and only this KUBECONFIG if any;
    preamble: Python run before it (a package made unimportable)."""
    clean = {key: value for key, value in os.environ.items()
             if key not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
    code = f"import sys\n{preamble}\nfrom rlhf_cli.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          env={**clean, "HOME": str(home), **env}, timeout=120)


def test_no_kubeconfig_at_all(tmp_path):
    result = rlhf("list", home=tmp_path)
    assert (result.returncode, result.stderr) == (1, f"rlhf: no cluster configured (no kubeconfig): {NO_CLUSTER}")


def test_a_kubeconfig_that_is_not_there(tmp_path):
    missing = tmp_path / "missing"
    result = rlhf("status", "job", home=tmp_path, KUBECONFIG=str(missing))
    assert (result.returncode, result.stderr) == (
        1, f"rlhf: no cluster configured ({missing}: Invalid kube-config file. No configuration found.): {NO_CLUSTER}")


def test_a_cluster_nobody_answers_for(tmp_path):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": "t"}}]}))
    result = rlhf("--kubeconfig", str(kubeconfig), "delete", "job", home=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("rlhf: cannot reach the cluster's API server: ") and "Connection refused" in result.stderr


def test_a_half_not_installed_is_named_with_its_extra(tmp_path):
    as_if_missing = "sys.modules['torch'] = sys.modules['kopf'] = None"
    trainer = rlhf("run", "manifests/examples/tiny-grpo-cpu-job.yaml", home=tmp_path, preamble=as_if_missing)
    assert trainer.returncode == 1 and trainer.stderr.startswith("`rlhf run` needs the trainer (")
    assert trainer.stderr.endswith("pip install 'rlhf-operator[trainer]'\n")
    operator = rlhf("operator", home=tmp_path, preamble=as_if_missing)
    assert operator.returncode == 1 and operator.stderr.endswith("pip install 'rlhf-operator[operator]'\n")


def test_version_is_the_installed_release_and_the_chart_s_app_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    chart = yaml.safe_load((REPO / "helm" / "rlhf-operator" / "Chart.yaml").read_text())
    assert exit.value.code == 0 and capsys.readouterr().out == f"rlhf {version('rlhf-operator')}\n"
    assert version("rlhf-operator") == chart["appVersion"]
