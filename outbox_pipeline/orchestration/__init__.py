"""Dagster room: sensors, jobs and schedules that operate the engine (no SQL or Kafka logic here)."""
