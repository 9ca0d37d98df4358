"""`outbox dev` asks its `dagster dev` to cancel the runs in progress before stopping it, so they end canceled, not
failed. See docs/dagster.md#the-local-stack-outbox-dev."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

_IN_PROGRESS = """
{ runsOrError(filter: {statuses: [QUEUED, NOT_STARTED, STARTING, STARTED]}) { ... on Runs { results { runId } } } }
"""
_TERMINATE = """
mutation ($ids: [String!]!) { terminateRuns(runIds: $ids) { __typename } }
"""


def graphql(port: int, query: str, variables: dict[str, object] | None = None) -> dict[str, object]:
    """One query to a local webserver's GraphQL API (as the UI asks it); its errors raised."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables or {}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        body: dict[str, object] = json.loads(response.read())
    if body.get("errors"):
        raise RuntimeError(str(body["errors"]))
    return body


def _in_progress(port: int) -> list[str]:
    data = graphql(port, _IN_PROGRESS)["data"]
    return [str(run["runId"]) for run in data["runsOrError"]["results"]]  # type: ignore[index]


def cancel_runs(port: int, timeout_s: float) -> list[str]:
    """Ask the webserver on ``port`` to terminate every run in progress and wait (up to ``timeout_s``) until none is;
    returns the runs asked. Best effort: a webserver that does not answer leaves the runs to the SIGINT."""
    try:
        runs = _in_progress(port)
        if runs:
            log.info("canceling %d Dagster run(s) in progress", len(runs))
            graphql(port, _TERMINATE, {"ids": runs})
        deadline, pause = time.monotonic() + timeout_s, threading.Event()  # never set: a pause between looks
        waiting = runs
        while waiting and time.monotonic() < deadline:
            pause.wait(0.5)
            waiting = [run for run in _in_progress(port) if run in runs]
        if waiting:
            log.warning(
                "%d Dagster run(s) still in progress after %.0f s; stopping them with dagster dev",
                len(waiting),
                timeout_s,
            )
        return runs
    except (OSError, urllib.error.URLError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        log.warning("could not cancel the Dagster runs in progress (%s); stopping them with dagster dev", exc)
        return []
