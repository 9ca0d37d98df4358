"""The Spark session resource (dagster-pyspark): `local[*]` by default, any master by configuration, never by code. See
docs/spark.md#configuration-and-deployment."""

from __future__ import annotations

import os
import sys
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from outbox_pipeline.settings import SPARK_MASTER

# What the outbox's Spark jobs rely on, overridable like any setting except where noted in the assets.
_DEFAULT_CONF: dict[str, str] = {
    # A speculative second attempt of a drain task would publish a partition twice, interleaved.
    "spark.speculation": "false",
    # Drains and archives never shuffle; keep incidental shuffles small.
    "spark.sql.shuffle.partitions": "8",
}
# On a single machine, stay on loopback (this also spares Spark a hostname lookup).
_LOCAL_CONF: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}


class SparkResource(dg.ConfigurableResource):
    """A SparkSession for the outbox's bulk drain and partition maintenance."""

    master: str = Field(
        default=SPARK_MASTER.default, description="local[*], spark://host:7077, k8s://https://..., yarn"
    )
    app_name: str = Field(default="outbox-pipeline", description="application name shown by the Spark UI")
    spark_conf: dict[str, str] = Field(
        default_factory=dict, description="any Spark property, e.g. spark.executor.memory; wins over the defaults"
    )
    python: str | None = Field(
        default=None,
        description="Python of the Spark workers (must import outbox_pipeline); default: PYSPARK_PYTHON, else "
        "this interpreter (right for local masters and for clusters with the same virtualenv path)",
    )

    _session: Any = PrivateAttr(default=None)

    @classmethod
    def from_env(cls, **overrides: Any) -> SparkResource:
        """The master from SPARK_MASTER (``local[*]`` when unset)."""
        return cls(master=SPARK_MASTER.read(), **overrides)

    def spark_config(self) -> dict[str, str]:
        local = self.master.startswith("local")
        return {
            **_DEFAULT_CONF,
            **(_LOCAL_CONF if local else {}),
            "spark.master": self.master,
            "spark.app.name": self.app_name,
            **self.spark_conf,
        }

    @property
    def session(self) -> Any:
        """The SparkSession (``pyspark.sql.SparkSession``), created on first use."""
        if self._session is None:
            # PySpark starts every Python worker, including those planning a Python data source on the
            # driver, with PYSPARK_PYTHON (read from the environment, not from spark.pyspark.python).
            if self.python:
                os.environ["PYSPARK_PYTHON"] = self.python
            else:
                os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            # Imported here: loading the Dagster definitions should not load Spark.
            from dagster_pyspark.resources import spark_session_from_config

            self._session = spark_session_from_config(self.spark_config())  # type: ignore[no-untyped-call]
        return self._session
