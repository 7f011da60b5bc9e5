"""The chart's monitoring objects against what really runs: the PrometheusRule's alerts checked and
unit-tested by promtool (firing and not firing, e2e/monitoring/alerts-test.yaml), and every metric
the alerts and the Grafana dashboard query served by the operator's or a trainer's exporter,
started for real and scraped over HTTP.

helm and promtool come from e2e/build/build.sh (built from their Go modules, cached).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import kopf
import pytest
import yaml

from e2e.controlplane.binaries import built
from rlhf_operator import metrics
from rlhf_trainer.prometheus import PrometheusReporter

pytestmark = pytest.mark.needs_build  # helm and promtool from e2e/build/build.sh

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rlhf-operator"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"
ALERT_TESTS = ROOT / "e2e" / "monitoring" / "alerts-test.yaml"
# What alerts-test.yaml assumes; none is the chart's default, so a threshold the template ignored fails.
THRESHOLDS = {"provisioningMinutes": 25, "queuedMinutes": 60, "noProgressMinutes": 20, "reconcileErrorMinutes": 10}

# PromQL words that are not metric names: operators, grouping modifiers, and `offset`/`bool`.
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "bool", "offset", "atan2"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\{[^}]*\}|[a-zA-Z_:][\w:]*|\S')
MATCHER_LABEL = re.compile(r'([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)')


@pytest.fixture(scope="module")
def promtool() -> str:
    return built("promtool", "PROMTOOL")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> list[dict]:
    """The chart with every monitoring object on and the test's thresholds."""
    helm = built("helm", "HELM")
    home = tmp_path_factory.mktemp("helm-home")
    values = home / "values.yaml"
    values.write_text(yaml.safe_dump({
        "serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True, "thresholds": THRESHOLDS}, "grafanaDashboard": {"enabled": True}}))
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}
    out = subprocess.run([helm, "template", "rlhf", str(CHART), "-f", str(values)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rule_groups(rendered: list[dict]) -> list[dict]:
    return next(d for d in rendered if d["kind"] == "PrometheusRule")["spec"]["groups"]


def dashboard_queries(rendered: list[dict]) -> list[str]:
    """Every panel target's expr of the dashboard as the ConfigMap ships it."""
    configmap = next(d for d in rendered if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    dashboard = json.loads(configmap["data"]["rlhf-operator.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names of its matchers) of every vector selector in a PromQL expression."""
    tokens = TOKEN.findall(expr)
    found, i = [], 0
    while i < len(tokens):
        token, after = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in GROUPING and after == "(":
            i = tokens.index(")", i)  # a label list, not metric names
        elif re.fullmatch(r"[a-zA-Z_:][\w:]*", token) and token not in KEYWORDS and after not in ("(", "by", "without"):
            found.append((token, set(MATCHER_LABEL.findall(after)) if after.startswith("{") else set()))
        i += 1
    return found


def test_selectors_are_parsed_out_of_promql():
    expr = ('histogram_quantile(0.95, sum by (le, handler) (rate(a_bucket{x=~"$v"}[5m]))) > on (ns) '
            'group_left (reason) time() - max by (ns) (b{phase="Running", y!="}"}) and sum(c) without (d)')
    assert selectors(expr) == [("a_bucket", {"x"}), ("b", {"phase", "y"}), ("c", set())]


def test_alert_rules_pass_promtool_checks_and_unit_tests(promtool, rendered, tmp_path):
    groups = rule_groups(rendered)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts-test.yaml")
    check = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0 and "SUCCESS: 5 rules found" in check.stdout, check.stdout + check.stderr
    test = subprocess.run([promtool, "test", "rules", "alerts-test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert test.returncode == 0 and "SUCCESS" in test.stdout, test.stdout + test.stderr

    # Each alert is tested both firing and not firing.
    cases = [case for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"] for case in t["alert_rule_test"]]
    for alert in (rule["alert"] for group in groups for rule in group["rules"]):
        outcomes = {bool(case["exp_alerts"]) for case in cases if case["alertname"] == alert}
        assert outcomes == {True, False}, f"{alert}: alerts-test.yaml must test it firing and not firing"


def test_promtool_unit_tests_fail_when_an_alert_misbehaves(promtool, rendered, tmp_path):
    """The rule tests can fail: with the no-progress threshold doubled, the alert expected at 32m does not fire."""
    groups = rule_groups(rendered)
    for rule in groups[0]["rules"]:
        rule["expr"] = rule["expr"].replace(f"> {THRESHOLDS['noProgressMinutes']} * 60", "> 40 * 60")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(ALERT_TESTS, tmp_path / "alerts-test.yaml")
    test = subprocess.run([promtool, "test", "rules", "alerts-test.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert test.returncode != 0 and "RLHFJobNoProgress" in test.stdout + test.stderr


def test_dashboard_queries_are_valid_promql(promtool, rendered, tmp_path):
    """promtool parses every panel query (as a recording rule), Grafana's $__rate_interval as 5m."""
    queries = dashboard_queries(rendered)
    rules = [{"record": f"dashboard:panel_{i}", "expr": q.replace("$__rate_interval", "5m")} for i, q in enumerate(queries)]
    (tmp_path / "dashboard.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run([promtool, "check", "rules", "dashboard.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0 and f"SUCCESS: {len(rules)} rules found" in check.stdout, check.stdout + check.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from a /metrics endpoint over HTTP."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    exposed: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            match = re.match(r"([a-zA-Z_:][\w:]*)(\{.*\})?\s", line)
            exposed.setdefault(match.group(1), set()).update(re.findall(r'(\w+)="', match.group(2) or ""))
    return exposed


@pytest.fixture(scope="module")
def exposed() -> dict[str, set[str]]:
    """Both exporters, run as in their processes, with a job seen, a handler run that failed and a
    trainer step and checkpoint behind them."""
    operator_port, trainer_port = free_port(), free_port()
    metrics.serve(operator_port)
    metrics.JOBS.seen("uid-monitoring-test", "ml", "grpo", {"phase": "Running", "reason": "Training",
                                                          "usage": {"gpuSeconds": 7200, "cpuSeconds": 900.5}})
    with metrics.measured("monitoring-test"):
        pass
    with pytest.raises(kopf.PermanentError), metrics.measured("monitoring-test"):
        raise kopf.PermanentError("bad spec")
    reporter = PrometheusReporter(trainer_port, job="grpo", namespace="ml")
    reporter.start(total_steps=10)
    reporter.log(1, {"reward_mean": 0.5})
    reporter.checkpoint(1, "/checkpoints/step-1")
    try:
        operator, trainer = scrape(operator_port), scrape(trainer_port)
    finally:
        metrics.JOBS.gone("uid-monitoring-test")
    assert "rlhf_job_phase" in operator and "rlhf_last_progress_timestamp_seconds" in trainer
    return {name: operator.get(name, set()) | trainer.get(name, set()) for name in operator.keys() | trainer.keys()}


def test_every_metric_an_alert_or_panel_queries_is_exposed(rendered, exposed):
    queries = [rule["expr"] for group in rule_groups(rendered) for rule in group["rules"]]
    queries += dashboard_queries(rendered)
    used = {}
    for query in queries:
        for name, labels in selectors(query):
            used.setdefault(name, set()).update(labels)
    assert len(used) >= 20  # operator and trainer series both
    missing = sorted(set(used) - set(exposed))
    assert not missing, f"queried but no exporter serves them: {missing}"
    for name, labels in used.items():
        assert labels <= exposed[name], f"{name} is matched on {sorted(labels - exposed[name])}, which it does not carry"


def test_dashboard_variables_come_from_exposed_labels(exposed):
    variables = [v for v in json.loads(DASHBOARD.read_text())["templating"]["list"] if v["type"] == "query"]
    assert {v["name"] for v in variables} == {"namespace", "job"}
    for variable in variables:
        expr, label = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["query"]["query"]).groups()
        [(name, matched)] = selectors(expr)
        assert name in exposed and ({label} | matched) <= exposed[name], variable["query"]
