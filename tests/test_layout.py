"""Layout: the engine imports neither Dagster nor Spark; the Dagster definitions load."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import dagster as dg

# Dagster rooms inside the package; every other module of it is engine (found by walking the package, so a new
# module is checked without being listed).
DAGSTER_ROOMS = ("outbox_pipeline.orchestration", "outbox_pipeline.definitions")


def _engine_modules() -> list[str]:
    import outbox_pipeline

    found = ["outbox_pipeline"]
    for info in pkgutil.walk_packages(outbox_pipeline.__path__, "outbox_pipeline."):
        if not info.name.startswith(DAGSTER_ROOMS):
            found.append(info.name)
    return found


ENGINE_MODULES = _engine_modules()


def test_the_engine_is_every_module_outside_the_dagster_rooms() -> None:
    assert {"outbox_pipeline.relay", "outbox_pipeline.strategies.offsets", "outbox_pipeline.bench.writers"} <= set(
        ENGINE_MODULES
    )
    assert not [m for m in ENGINE_MODULES if m.startswith(DAGSTER_ROOMS)]


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
        "import sys, assets.spark.datasource, assets.spark.drain_job\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] == 'dagster')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_asset_package_exports_are_definitions_even_after_their_modules_were_imported() -> None:
    import assets.spark.bulk_drain_asset  # noqa: F401 - a submodule import must not shadow the export
    from assets.spark import bulk_drain, spark_assets

    assert isinstance(bulk_drain, dg.AssetsDefinition)
    assert all(isinstance(a, dg.AssetsDefinition) for a in spark_assets)
