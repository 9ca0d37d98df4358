"""Dagster room: the one module that wires assets, resources, sensors and schedules together.

`dagster dev` loads it through workspace.yaml; resources take their configuration from the
environment (OUTBOX_PG_DSN, OUTBOX_SCHEMA).
"""

from __future__ import annotations

import os

import dagster as dg

from assets import outbox_backlog
from outbox_pipeline.config import DEFAULT_SCHEMA
from resources import PostgresResource

defs = dg.Definitions(
    assets=[outbox_backlog],
    resources={
        "postgres": PostgresResource(
            dsn=dg.EnvVar("OUTBOX_PG_DSN"),
            # Optional: the default schema unless OUTBOX_SCHEMA names another.
            schema_name=dg.EnvVar("OUTBOX_SCHEMA") if "OUTBOX_SCHEMA" in os.environ else DEFAULT_SCHEMA,
        ),
    },
)
