"""A `relay_stream` run in a process of its own, as a run worker is (so a test can kill -9 it).

Usage: python -m tests.dagster.stream_run_process WINDOW_S REPORT_S [RERUN_OF]; the instance is DAGSTER_HOME's,
the resources come from OUTBOX_PG_DSN, OUTBOX_SCHEMA, KAFKA_BOOTSTRAP_SERVERS and the orchestration settings.
"""

import os
import sys

import dagster as dg

from outbox_pipeline.orchestration.relay_stream import relay_stream_job
from outbox_pipeline.orchestration.settings import OrchestrationSettings
from outbox_pipeline.resources import KafkaResource, PostgresResource


def stream_job() -> dg.JobDefinition:
    defs = dg.Definitions(
        jobs=[relay_stream_job],
        resources={
            "postgres": PostgresResource(dsn=os.environ["OUTBOX_PG_DSN"], schema_name=os.environ["OUTBOX_SCHEMA"]),
            "kafka": KafkaResource(bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"]),
            "orchestration": OrchestrationSettings.from_env(),
        },
    )
    return defs.resolve_job_def("relay_stream")


def main(window_s: str, report_s: str, rerun_of: str | None = None) -> int:
    config = {
        "ops": {"relay_outbox_stream": {"config": {"window_s": float(window_s), "report_interval_s": float(report_s)}}}
    }
    with dg.DagsterInstance.get() as instance:
        options = dg.ReexecutionOptions.from_failure(rerun_of, instance) if rerun_of else None
        result = dg.execute_job(
            dg.reconstructable(stream_job),
            instance,
            run_config=None if options else config,
            reexecution_options=options,
        )
        return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
