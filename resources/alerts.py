"""Alerts to a webhook (empty URL: log only); sending never raises, because alerting must never take down what it
reports on. See docs/dagster.md#alerts."""

import datetime as dt
import json
import logging
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import dagster as dg
from pydantic import Field

from outbox_pipeline.settings import ALERT_WEBHOOK_URL

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alert:
    """One alert. ``text`` is a one-line summary (Slack-compatible webhooks display it as is)."""

    alert: str  # what fired: "outbox_lag_slo", "relay_run_failed"
    status: Literal["firing", "resolved"]
    severity: str  # "WARN", "ERROR", "OK"
    text: str
    partitions: Sequence[Mapping[str, object]] = ()
    details: Mapping[str, object] = field(default_factory=dict)
    source: str = "outbox-pipeline"
    at: str = field(default_factory=lambda: dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))

    def payload(self) -> dict[str, object]:
        body = asdict(self)
        body["partitions"] = [dict(p) for p in self.partitions]
        body["details"] = dict(self.details)
        return body


class AlertResource(dg.ConfigurableResource):
    """Where alerts go: always the log; also an HTTP POST of the JSON payload when the URL is set."""

    webhook_url_env: str = Field(
        default=ALERT_WEBHOOK_URL.name, description="environment variable holding the webhook URL (empty: log only)"
    )
    timeout_s: float = Field(default=5.0, description="HTTP timeout of one delivery")

    def send(self, alert: Alert, logger: logging.Logger | dg.DagsterLogManager | None = None) -> bool:
        """Log the alert and post it; True when delivered (or when no webhook is configured)."""
        out = logger or log
        out.warning("ALERT %s %s [%s]: %s", alert.alert, alert.status, alert.severity, alert.text)
        url = os.environ.get(self.webhook_url_env, "").strip()
        if not url:
            return True
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            # urllib would raise with the URL in its message, on the tick that must alert; the URL holds a token.
            out.error(
                "alert %s %s not delivered: %s is not an http:// or https:// URL (its value is not shown: it may "
                "hold a token)",
                alert.alert,
                alert.status,
                self.webhook_url_env,
            )
            return False
        try:
            request = urllib.request.Request(
                url,
                data=json.dumps(alert.payload(), default=str).encode(),
                headers={"Content-Type": "application/json", "User-Agent": "outbox-pipeline-alerts"},
                method="POST",
            )
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
            return True
        except Exception as exc:  # never fail the caller: report and carry on
            reason = str(exc.reason if isinstance(exc, urllib.error.URLError) else exc).replace(url, "<webhook URL>")
            out.error("alert %s %s not delivered to the webhook: %s", alert.alert, alert.status, reason)
            return False
