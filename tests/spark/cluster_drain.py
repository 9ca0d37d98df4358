"""Run ``bulk_drain`` in a process of its own (one SparkContext per process) against a given Spark master.

Usage: cluster_drain.py DSN SCHEMA BOOTSTRAP MASTER APP_NAME. Prints the materialization's metadata as
one JSON line and exits 0 when the run succeeded. Only configuration differs from a local run.
"""

from __future__ import annotations

import json
import sys

import dagster as dg

from outbox_pipeline.assets.spark import bulk_drain
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources.kafka import KafkaResource
from outbox_pipeline.resources.postgres import PostgresResource
from outbox_pipeline.resources.spark import SparkResource


def main(dsn: str, schema: str, bootstrap: str, master: str, app_name: str) -> int:
    spark = SparkResource(
        master=master,
        app_name=app_name,
        spark_conf={
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.executor.memory": "512m",
            "spark.executor.cores": "2",
            "spark.cores.max": "2",
        },
    )
    try:
        result = dg.materialize(
            [bulk_drain],
            resources={
                "postgres": PostgresResource(dsn=dsn, schema_name=schema),
                "kafka": KafkaResource(bootstrap_servers=bootstrap),
                "spark": spark,
                "orchestration": OrchestrationSettings(strategy="partitioned"),
            },
            raise_on_error=False,
        )
        materializations = result.asset_materializations_for_node("bulk_drain")
        metadata = {k: v.value for m in materializations for k, v in m.metadata.items()}
        print(json.dumps({"success": result.success, "metadata": metadata}, default=str))
        return 0 if result.success else 1
    finally:
        spark.session.stop()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
