"""The settings catalogue: every variable the project reads or documents is declared once, read with a
clear error, and shown by `outbox settings` without its secrets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from outbox_pipeline import settings
from outbox_pipeline.config import OutboxTable
from outbox_pipeline.errors import ConfigurationError
from outbox_pipeline.observe import LagThresholds, liveness_from_env

ROOT = Path(__file__).resolve().parents[3]
NAMES = {s.name for s in settings.CATALOGUE}
# Python names that merely start like a variable.
NOT_VARIABLES = {"OUTBOX_PARTITIONS_NAME"}


def _mentions() -> dict[str, set[str]]:
    """Every OUTBOX_* token in the packages, the docs and the deployment examples -> the files naming it."""
    files = [p for d in ("outbox_pipeline", "resources", "assets") for p in (ROOT / d).rglob("*.py")]
    files += [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "outbox_pipeline" / "deploy").rglob("*")]
    found: dict[str, set[str]] = {}
    for path in files:
        if path.is_file() and path.name != "settings.py":
            for token in re.findall(r"\bOUTBOX_[A-Z0-9_]+", path.read_text(errors="replace")):
                found.setdefault(token, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_outbox_variable_the_code_and_the_docs_name_is_declared_in_the_catalogue() -> None:
    mentions = _mentions()
    assert {"OUTBOX_PG_DSN", "OUTBOX_RELAY_STRATEGY", "OUTBOX_LIVENESS"} <= set(mentions)
    unknown = {
        token: sorted(paths)
        for token, paths in mentions.items()
        if token not in NAMES
        and token not in NOT_VARIABLES
        and not (token.endswith("_") and any(name.startswith(token) for name in NAMES))
    }
    assert unknown == {}


def test_each_setting_is_declared_once() -> None:
    names = [s.name for s in settings.CATALOGUE]
    assert len(names) == len(set(names))


def test_a_malformed_value_names_the_variable_and_what_it_must_be() -> None:
    with pytest.raises(ConfigurationError, match=r"OUTBOX_LAG_WARN_PENDING='lots': must be an integer"):
        LagThresholds.from_env({"OUTBOX_LAG_WARN_PENDING": "lots"})
    with pytest.raises(ConfigurationError, match=r"OUTBOX_LIVENESS='forever': choose one of auto, session, expiry"):
        liveness_from_env({"OUTBOX_LIVENESS": "forever"})


def test_an_unset_or_empty_variable_means_its_default() -> None:
    assert OutboxTable.from_env({}) == OutboxTable.from_env({"OUTBOX_SCHEMA": " "}) == OutboxTable(schema="outbox")
    assert LagThresholds.from_env({"OUTBOX_LAG_ERROR_AGE_S": "600"}).error_age_s == 600.0


def test_outbox_settings_shows_the_values_in_effect_and_never_a_secret() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "OUTBOX_PG_DSN": "host=db user=relay password=hunter2",
        "OUTBOX_ALERT_WEBHOOK_URL": "https://hooks.example/T0KEN-abc",
        "OUTBOX_RELAY_RUNS_MAX": "7",
        "KAFKA_BOOTSTRAP_SERVERS": "kafka:9092",
        "KAFKA_SASL_PASSWORD": "s3cret-pw",
    }
    out = subprocess.run(
        [sys.executable, "-m", "outbox_pipeline.cli", "settings", "--json"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    shown = {row["name"]: row for row in json.loads(out)}
    assert set(shown) == NAMES | {"KAFKA_BOOTSTRAP_SERVERS", "KAFKA_SASL_PASSWORD"}
    assert (shown["OUTBOX_RELAY_RUNS_MAX"]["value"], shown["OUTBOX_RELAY_RUNS_MAX"]["source"]) == ("7", "set")
    assert (shown["OUTBOX_SCHEMA"]["value"], shown["OUTBOX_SCHEMA"]["source"]) == ("outbox", "default")
    assert "user=relay" in shown["OUTBOX_PG_DSN"]["value"]
    assert shown["KAFKA_BOOTSTRAP_SERVERS"]["value"] == "kafka:9092"
    for secret in ("hunter2", "T0KEN", "s3cret-pw"):
        assert secret not in out
    assert all(row["meaning"] for row in shown.values())
