"""The documentation site (mkdocs.yml, docs/): it builds, and what it shows is what the code does.

Conventions the pages follow (docs/contributing.md):
- `--8<-- "path"` includes a repository file (an example job) or a marked section of one; the checks
  below read a page with its whole-file includes expanded, as the site shows it.
- A shell block right after a `<!-- runnable -->` line is run here from the repository root, with
  .venv/bin first on the PATH, and must exit 0: only cheap offline commands (`rlhf validate`, `--help`).
  Any other shell block needs a cluster, a GPU or a long run, or is an illustration; it is not run.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_api import reference
from rlhf_api.validation import validate
from rlhf_cli import cli
from rlhf_operator import reasons, status

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
INCLUDE = re.compile(r'^--8<-- "([^":]+)"$', re.M)
BLOCK = re.compile(r"^(<!-- runnable -->\n)?```(\w+)[^\n]*\n(.*?)^```", re.M | re.S)


def page_text(page: Path) -> str:
    return INCLUDE.sub(lambda m: (ROOT / m.group(1)).read_text(), page.read_text())


def blocks(language: str) -> list[tuple[Path, bool, str]]:
    """Every fenced block of that language in the pages: (page, marked runnable, body)."""
    return [(page, bool(m.group(1)), m.group(3)) for page in PAGES
            for m in BLOCK.finditer(page_text(page)) if m.group(2) == language]


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                           cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "spec.training.kl" in (site / "reference/api/index.html").read_text()
    troubleshooting = (site / "troubleshooting/index.html").read_text()
    assert "<!-- status-reasons -->" not in troubleshooting and "VolumeNotShared" in troubleshooting
    assert "sft-llama3-8b" in (site / "algorithms/sft/index.html").read_text()  # the example was included


def _crd_fields(node: dict, path: str) -> list[tuple[str, str]]:
    """(object path, field name) of every field under node, read from the checked-in CRD."""
    if "items" in node:
        return _crd_fields(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        return _crd_fields(node["additionalProperties"], f"{path}.*")
    found = []
    for name, child in node.get("properties", {}).items():
        found += [(path, name), *_crd_fields(child, f"{path}.{name}")]
    return found


def test_api_reference_names_every_spec_field():
    crd = yaml.safe_load((ROOT / "crds/rlhf.dev_rlhfjobs.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    sections = dict(re.findall(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", reference.markdown(), re.M | re.S))
    fields = _crd_fields(spec, "spec")
    assert len(fields) > 200
    missing = [f"{parent}.{name}" for parent, name in fields
               if f"\n| `{name}`" not in sections.get(parent, "")]
    assert not missing


def test_every_rlhfjob_in_the_docs_is_valid():
    jobs = [(page, document) for page, _, body in blocks("yaml") for document in yaml.safe_load_all(body)
            if isinstance(document, dict) and document.get("kind") == "RLHFJob"]
    assert {page.name for page, _ in jobs} >= {"online-rl.md", "preference.md", "sft.md", "reward-model.md"}
    for page, job in jobs:
        validate(job)  # raises InvalidJob naming the field


def test_runnable_shell_blocks_run():
    runnable = [(page, body) for language in ("bash", "sh") for page, marked, body in blocks(language) if marked]
    assert len(runnable) >= 5
    env = {**os.environ, "PATH": f"{ROOT / '.venv/bin'}{os.pathsep}{os.environ['PATH']}"}
    for page, body in runnable:
        ran = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, f"{page.relative_to(ROOT)}:\n{body}\n{ran.stdout[-2000:]}{ran.stderr[-2000:]}"


# Calls whose argument at that position is a status or Event reason, by the called name.
REASON_ARGUMENT = {"Observation": 1, "wait": 1, "fail": 1, "Unrealisable": 0, "Waiting": 0, "CodeConfigMap": 1,
                   "_input_failed": 0}
REASON_SOURCES = [*sorted((ROOT / "operator/rlhf_operator").glob("*.py")), ROOT / "operator/rlhf_api/v1alpha1/job.py"]


def _reasons_set_in(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            position = REASON_ARGUMENT.get(name)
            arguments = [*node.args[position:position + 1]] if position is not None else []
            arguments += [keyword.value for keyword in node.keywords if keyword.arg == "reason"]
            found |= {a.value for a in arguments if isinstance(a, ast.Constant) and isinstance(a.value, str)}
        # status._verdict returns (phase, reason, message), its reason maybe `kuberay_reason or "RayJobFailed"`
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple) and len(node.value.elts) == 3:
            reason = node.value.elts[1]
            for said in reason.values if isinstance(reason, ast.BoolOp) else [reason]:
                if isinstance(said, ast.Constant) and isinstance(said.value, str):
                    found.add(said.value)
    return found


def test_every_reason_the_operator_sets_is_documented():
    set_in_code = set().union(*(_reasons_set_in(ast.parse(path.read_text())) for path in REASON_SOURCES))
    set_in_code |= {reason for reason, _ in status.NEUTRAL.values()}
    assert {"Completed", "VolumeNotShared", "RewardConfigMapNotFound", "TTLExpired", "NotFinished"} <= set_in_code
    assert set_in_code - set(reasons.REASONS) == set(), "add them to operator/rlhf_operator/reasons.py"
    assert set(reasons.REASONS) - set_in_code == set(), "set nowhere: remove them from reasons.py"


@pytest.mark.parametrize("command", sorted(next(
    action for action in cli.parser()._actions if action.dest == "command").choices))
def test_every_subcommand_is_on_the_cli_page(command):
    assert f"`rlhf {command}" in (DOCS / "cli.md").read_text()
