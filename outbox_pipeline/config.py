"""Configuration from environment variables, named after the libraries they configure, and secret-safe rendering of it.
See docs/operations.md#command-line."""

from __future__ import annotations

import datetime as dt
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import settings
from .errors import ConfigurationError

ENV_PG_DSN = settings.PG_DSN.name
ENV_KAFKA_PREFIX = "KAFKA_"
DEFAULT_SCHEMA = settings.SCHEMA.default
# PostgreSQL truncates identifiers longer than NAMEDATALEN - 1 bytes; refuse them instead.
_MAX_IDENTIFIER_BYTES = 63

# A setting is secret when its name says so: librdkafka properties and libpq keywords alike
# (sasl.password, sasl.oauthbearer.config, sasl.oauthbearer.client.secret, ssl.key.pem, ssl.keystore.password,
# sasl.kerberos.keytab, sslpassword, a JAAS config, ...). A pattern, not a list: a property added later
# is hidden by default. SHOWN_ANYWAY names the settings that match but hold no secret.
SECRET_NAME = re.compile(
    r"pass|secret|token|credential|jaas|keytab|oauthbearer\.config|pem|private|(^|[._])key($|[._])"
)
SHOWN_ANYWAY = frozenset(
    {
        "ssl.key.location",  # a path, not the key
        "ssl.keystore.location",
        "ssl.certificate.location",
        "ssl.ca.location",
        "sslkey",  # libpq: path of the client key file
        "sslcert",
        "sslrootcert",
        "sasl.kerberos.service.name",
        "sasl.kerberos.principal",
        "sasl.oauthbearer.token.endpoint.url",
        "passfile",  # libpq: path of the password file
    }
)
REDACTED = "***"


@dataclass(frozen=True)
class OutboxTable:
    """Where the outbox lives and how big one message may be; composes every identifier safely."""

    schema: str = DEFAULT_SCHEMA
    max_message_bytes: int = settings.MAX_MESSAGE_BYTES.default
    write_to: str = settings.WRITE_TO.default  # how enqueue() writes: "table" or "wal" (settings.WRITE_TO)

    def __post_init__(self) -> None:
        if not self.schema or len(self.schema.encode("utf-8")) > _MAX_IDENTIFIER_BYTES:
            raise ConfigurationError(
                f"schema name must be 1..{_MAX_IDENTIFIER_BYTES} bytes, got {len(self.schema.encode())}"
            )
        if "\x00" in self.schema:
            raise ConfigurationError("schema name must not contain NUL")
        if self.max_message_bytes < 1:
            raise ConfigurationError(f"max_message_bytes must be >= 1, got {self.max_message_bytes}")
        if self.write_to not in ("table", "wal"):
            raise ConfigurationError(f"write_to must be 'table' or 'wal', got {self.write_to!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OutboxTable:
        return cls(
            schema=settings.SCHEMA.read(env),
            max_message_bytes=settings.MAX_MESSAGE_BYTES.read(env),
            write_to=settings.WRITE_TO.read(env),
        )

    def ident(self, name: str) -> sql.Identifier:
        """A schema-qualified identifier for one of the outbox's relations."""
        return sql.Identifier(self.schema, name)

    @cached_property
    def schema_ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema)

    @cached_property
    def messages(self) -> sql.Identifier:
        return self.ident("outbox_messages")

    @cached_property
    def offsets(self) -> sql.Identifier:
        return self.ident("outbox_offsets")

    @cached_property
    def leases(self) -> sql.Identifier:
        return self.ident("outbox_leases")

    @cached_property
    def dead_letters(self) -> sql.Identifier:
        return self.ident("outbox_dead_letters")

    @cached_property
    def holds(self) -> sql.Identifier:
        return self.ident("outbox_holds")

    @cached_property
    def held(self) -> sql.Identifier:
        return self.ident("outbox_held")

    @cached_property
    def workers(self) -> sql.Identifier:
        return self.ident("outbox_workers")

    @cached_property
    def topics(self) -> sql.Identifier:
        return self.ident("outbox_topics")

    @cached_property
    def strategy_record(self) -> sql.Identifier:
        return self.ident("outbox_strategy")

    @cached_property
    def migrations(self) -> sql.Identifier:
        return self.ident("outbox_schema_migrations")


def pg_dsn_from_env(env: Mapping[str, str] | None = None) -> str:
    dsn = settings.PG_DSN.read(env)
    if not dsn:
        raise ConfigurationError(
            f"{ENV_PG_DSN} is not set: give a libpq DSN such as 'host=127.0.0.1 port=55432 user=postgres "
            "dbname=postgres' or a postgresql:// URI (or pass --dsn)"
        )
    check_dsn(dsn)
    return dsn


def is_secret(name: str) -> bool:
    """Whether a setting's value must never be shown (see SECRET_NAME)."""
    name = name.lower()
    return name not in SHOWN_ANYWAY and SECRET_NAME.search(name) is not None


def redact_dsn(dsn: str) -> str:
    """The DSN with every secret-like keyword (password, sslpassword, ...) replaced: for logs, errors and metadata."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        # An unparsable DSN may still hold a secret: show nothing of it.
        return "<unparsable DSN>"
    shown = {k: (REDACTED if v and is_secret(k) else v) for k, v in params.items() if v is not None}
    return make_conninfo("", **shown)


def check_dsn(dsn: str) -> None:
    """Fail on a DSN libpq cannot parse with its reason and none of the DSN's text: libpq quotes the token it choked on,
    which may be the password (``postgresql://app:p%zz...@host/db``: an invalid percent-encoding)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        # What libpq quotes of the DSN goes (a one-character token such as "=" is its grammar, not the DSN's).
        reason = _QUOTED.sub(lambda m: '"..."' if len(m[1]) > 1 and m[1] in dsn else m[0], str(exc).strip())
        for match in _PASSWORD.finditer(dsn):
            reason = reason.replace(match.group(1) or match.group(2), REDACTED)
        hint = " (a SQLAlchemy URL? libpq's is postgresql://, without +driver)" if _DRIVER_URL.match(dsn) else ""
        raise ConfigurationError(
            f"the PostgreSQL DSN is not valid: {reason}{hint}; give a libpq key=value DSN or a postgresql:// URI "
            "(OUTBOX_PG_DSN or --dsn)"
        ) from None


_QUOTED = re.compile(r'"([^"]+)"')
# A password as a URI (scheme://user:PASSWORD@) or a keyword (password=VALUE) carries it, for the last scrub.
_PASSWORD = re.compile(r"://[^:/@]*:([^@]+)@|password\s*=\s*'?([^'\s]+)")
_DRIVER_URL = re.compile(r"^[a-z0-9]+\+[a-z0-9]+://", re.IGNORECASE)


def kafka_config_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """librdkafka properties from ``KAFKA_*`` variables (``KAFKA_SASL_USERNAME`` -> ``sasl.username``)."""
    env = os.environ if env is None else env
    config = {
        name[len(ENV_KAFKA_PREFIX) :].lower().replace("_", "."): value
        for name, value in env.items()
        if name.startswith(ENV_KAFKA_PREFIX) and len(name) > len(ENV_KAFKA_PREFIX)
    }
    if "bootstrap.servers" not in config:
        raise ConfigurationError("KAFKA_BOOTSTRAP_SERVERS is not set (or pass --bootstrap-servers)")
    return config


def settings_in_effect(env: Mapping[str, str] | None = None) -> list[tuple[str, str, str, str]]:
    """(name, value shown, "set" or "default", meaning) of every catalogued setting, then each ``KAFKA_*``
    property set; secrets redacted (a DSN keeps everything but its password)."""
    env = os.environ if env is None else env
    rows = []
    for setting in settings.CATALOGUE:
        value = str(setting.read(env)) if setting.is_set(env) else str(setting.default)
        if setting.secret and value:
            value = redact_dsn(value) if setting is settings.PG_DSN else REDACTED
        rows.append((setting.name, value, "set" if setting.is_set(env) else "default", setting.meaning))
    for name in sorted(n for n in env if n.startswith(ENV_KAFKA_PREFIX) and len(n) > len(ENV_KAFKA_PREFIX)):
        prop = name[len(ENV_KAFKA_PREFIX) :].lower().replace("_", ".")
        rows.append((name, REDACTED if is_secret(prop) else env[name], "set", f"librdkafka property {prop}"))
    return rows


def redact_kafka_config(config: Mapping[str, object]) -> dict[str, object]:
    """The config with every secret-like property replaced (see SECRET_NAME)."""
    return {key: (REDACTED if is_secret(key) else value) for key, value in config.items()}


def parse_timestamp(text: str, name: str = "timestamp") -> dt.datetime:
    """ISO-8601 (``2026-01-31T12:00:00+00:00``); a time without an offset is UTC. ``ConfigurationError`` names
    ``name`` (the flag or config field) when it is not a timestamp."""
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigurationError(f"{name}={text!r} is not an ISO-8601 time (e.g. 2026-01-31T12:00:00+00:00)") from None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def redact_kafka_error(exc: BaseException, config: Mapping[str, object]) -> str:
    """A librdkafka error's text with every secret value of ``config`` replaced: librdkafka may quote the
    value it rejects, and a wrong password is still a password."""
    error = exc.args[0] if exc.args else None
    message = str(error.str()) if error is not None and hasattr(error, "str") else str(exc)
    for name, shown in redact_kafka_config(config).items():
        value = str(config[name])
        if shown == REDACTED and value:
            message = message.replace(value, REDACTED)
    return message


def default_worker_id() -> str:
    """A Deployment's pods get new names: hostname and pid tell a restarted worker from its predecessor."""
    return f"{socket.gethostname()}-{os.getpid()}"
