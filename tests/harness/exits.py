"""An operator command's exit, judged by what it printed (ledger.py): 0 is done; 3 is ``relay --until-empty``
stopped by its ``--max-seconds`` (it says so); 2 is accepted only for a refusal the command documents, in one line
(``error: ...``): the server restarting, or what that command refuses and tells the operator to do first. Anything
else (exit 1, argparse's usage error, a refusal no command documents, a traceback, a hang) is a finding."""

from __future__ import annotations

import re

from .context import CliResult

DONE, REFUSED, NOT_EMPTY = 0, 2, 3
# Any command: the CLI's line for a database it cannot reach (cli/__init__.py), as a PostgreSQL restart makes it.
_ANY = (r"cannot reach PostgreSQL",)
# What each command refuses and documents (its error line), by the command's first word.
_REFUSALS: dict[str, tuple[str, ...]] = {
    "replay": (  # operate/operations.py: a rewind's refusals
        r"has no stored position",
        r"is leased by live worker",
        r"has no rows created at or after",
        r"that would skip rows",
        r"has no row with id",
    ),
    "switch-strategy": (  # operate/switch.py
        r"stop the relays before switching strategy",
        r"keys are held behind dead letters",
        r"rows held behind retried or discarded dead letters are not relayed yet",
        r"writer transactions on the outbox did not end within",
        r"no procedure moves a wal outbox to",  # store/strategy_record.py: a wal outbox switches to nothing
    ),
    "indexes": (r"did not get its lock",),  # store/indexes.py: --drop-others behind a writer's transaction
    "init-db": (  # store/schema.py's migration lock; store/wal/objects.py: the slot behind open transactions
        r"did not get its lock",
        r"was not created within",
    ),
}


def failed(command: CliResult) -> bool:
    """Whether the command's exit, read with its output, is a finding."""
    if command.code is None or "Traceback" in command.output:
        return True
    if command.code == DONE:
        return False
    if command.code == NOT_EMPTY:
        drain = command.argv[:1] == ("relay",) and "--until-empty" in command.argv
        return not (drain and "not empty after --max-seconds" in command.output)
    if command.code != REFUSED or re.search(r"^usage: ", command.output, re.MULTILINE):
        return True
    refusals = _ANY + _REFUSALS.get(command.argv[0] if command.argv else "", ())
    errors = re.findall(r"^error: (.*)$", command.output, re.MULTILINE)
    return not any(re.search(pattern, line) for line in errors for pattern in refusals)
