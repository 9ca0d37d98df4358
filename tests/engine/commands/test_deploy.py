"""The deployment examples say what the code does: the Kubernetes manifest's relay flags parse with the CLI, its
probes and Prometheus annotations point at the port the worker serves, its variables are the ones the code reads,
and every metric the Grafana dashboard queries is one a relay worker exposes. No cluster is needed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import psycopg
import yaml

from outbox_pipeline import OutboxTable
from outbox_pipeline.cli import build_parser
from outbox_pipeline.observe import LagSampler, RelayMetrics

DEPLOY = Path(__file__).resolve().parents[3] / "outbox_pipeline" / "deploy"
ROOT = Path(__file__).resolve().parents[3]


def _documents() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text()))


def _relay_container() -> tuple[dict[str, Any], dict[str, Any]]:
    [statefulset] = [d for d in _documents() if d["kind"] == "StatefulSet"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    return statefulset, container


def test_the_relay_statefulsets_arguments_are_flags_the_cli_accepts() -> None:
    _, container = _relay_container()
    args = [a.replace("$(POD_NAME)", "outbox-relay-0") for a in container["args"]]

    parsed = build_parser().parse_args(args)

    assert (container["command"], parsed.func.__name__) == (["outbox"], "cmd_relay")
    assert parsed.worker_id == "outbox-relay-0" and parsed.metrics_port == 9400


def test_the_probes_and_scrape_annotations_use_the_port_the_worker_serves_metrics_on() -> None:
    statefulset, container = _relay_container()
    port = int(container["args"][container["args"].index("--metrics-port") + 1])
    annotations = statefulset["spec"]["template"]["metadata"]["annotations"]

    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(port), "/metrics")


def test_every_variable_the_manifest_sets_is_one_the_code_reads() -> None:
    names = {
        name
        for doc in _documents()
        if doc["kind"] in ("ConfigMap", "Secret") and doc["metadata"]["name"] != "dagster-instance"
        for name in {**doc.get("data", {}), **doc.get("stringData", {})}
    }
    sources = "\n".join(
        p.read_text() for d in ("outbox_pipeline", "resources", "assets") for p in (ROOT / d).rglob("*.py")
    )

    unknown = [n for n in names if not n.startswith("KAFKA_") and f'"{n}"' not in sources]
    assert not unknown, f"variables the code never reads: {unknown}"


def test_the_dagster_instance_config_launches_runs_on_kubernetes_with_run_monitoring() -> None:
    [instance] = [d for d in _documents() if d["metadata"]["name"] == "dagster-instance"]
    config = yaml.safe_load(instance["data"]["dagster.yaml"])

    assert (config["run_launcher"]["module"], config["run_launcher"]["class"]) == ("dagster_k8s", "K8sRunLauncher")
    assert config["run_monitoring"]["enabled"] is True


def test_the_kubernetes_instance_keeps_the_local_instances_run_policy() -> None:
    """One relay_partition run per partition (so release_lease and replay_partition start beside a hung one) and no
    op-failure retries on top of the relay's RetryPolicy: what `outbox dev` runs with is what a deployment runs with."""
    [instance] = [d for d in _documents() if d["metadata"]["name"] == "dagster-instance"]
    deployed = yaml.safe_load(instance["data"]["dagster.yaml"])
    local = yaml.safe_load((ROOT / "outbox_pipeline" / "localstack" / "dagster.yaml").read_text())

    assert (
        deployed["concurrency"]["runs"]["tag_concurrency_limits"]
        == local["concurrency"]["runs"]["tag_concurrency_limits"]
    )
    assert deployed["run_retries"] == local["run_retries"]


def test_every_metric_the_dashboard_queries_is_exposed_by_a_relay_worker(
    db: psycopg.Connection, table: OutboxTable
) -> None:
    metrics = RelayMetrics("partitioned")
    sampler = LagSampler(db.info.dsn, table, "partitioned")
    sampler.sample()
    metrics.registry.register(sampler)
    exposed = {sample.name for family in metrics.registry.collect() for sample in family.samples}
    exposed |= {family.name for family in metrics.registry.collect()}
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\boutbox_[a-z_]+", target["expr"])
    }

    assert queried and queried <= exposed | {n.removesuffix("_bucket") for n in exposed}, queried - exposed
