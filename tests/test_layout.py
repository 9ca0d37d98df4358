"""Layout: the engine imports neither Dagster nor Spark; the Dagster definitions load."""

from __future__ import annotations

import subprocess
import sys

import dagster as dg

ENGINE_MODULES = [
    "outbox_pipeline",
    "outbox_pipeline.cli",
    "outbox_pipeline.config",
    "outbox_pipeline.demo",
    "outbox_pipeline.drain",
    "outbox_pipeline.enqueue",
    "outbox_pipeline.lag",
    "outbox_pipeline.lag_slo",
    "outbox_pipeline.partition_run",
    "outbox_pipeline.maintenance",
    "outbox_pipeline.operations",
    "outbox_pipeline.verify",
    "outbox_pipeline.bench.runner",
    "outbox_pipeline.publisher",
    "outbox_pipeline.relay",
    "outbox_pipeline.strategies.advisory",
    "outbox_pipeline.strategies.lease",
    "outbox_pipeline.strategies.locking",
    "outbox_pipeline.strategies.partitioned",
    "outbox_pipeline.strategies.serialized",
    "outbox_pipeline.partitioning",
    "outbox_pipeline.schema",
    "outbox_pipeline.localstack",
    "outbox_pipeline.localstack.dev",
]


def test_engine_modules_import_neither_dagster_nor_spark() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {ENGINE_MODULES!r}: importlib.import_module(m)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] in ('dagster', 'pyspark', 'dagster_pyspark'))\n"
        "print(','.join(leaked))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_dagster_definitions_load() -> None:
    from outbox_pipeline.definitions import defs

    dg.Definitions.validate_loadable(defs)


def test_spark_executors_import_the_data_sources_without_dagster() -> None:
    code = (
        "import sys, assets.spark.datasource\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_asset_package_exports_are_definitions_even_after_their_modules_were_imported() -> None:
    import assets.spark.bulk_drain_asset  # noqa: F401 - a submodule import must not shadow the export
    from assets.spark import bulk_drain, spark_assets

    assert isinstance(bulk_drain, dg.AssetsDefinition)
    assert all(isinstance(a, dg.AssetsDefinition) for a in spark_assets)
