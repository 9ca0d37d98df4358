"""``python -m tests.mutants [NAME ...]``: each mutant (tests/mutants/NAME.patch) applied alone to a scratch copy of
the working tree under /tmp (never to the tree itself), then the tests its ``Kill:`` lines name run there one after
the other until one fails: the mutant is killed by it. A patch that no longer applies (the code it changes moved on)
is reported as such, not run; a test command pytest cannot run (none selected, a collection error) is an error, not
a kill. Prints one line per mutant and the score; exit 1 unless every mutant that applies is killed. ``--list``
prints the mutants and their tests."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TESTS_FAILED = 1  # pytest's exit when a test failed (5: none selected, 2 and 4: it could not run them)
TIMEOUT_S = 1800.0  # one test command's limit: a mutant that hangs a test is killed by the hang


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    kills: tuple[tuple[str, ...], ...]  # pytest arguments, tried in order
    patch: Path


@dataclass(frozen=True)
class Outcome:
    mutant: Mutant
    verdict: str  # killed | survived | error (a kill line pytest could not run) | does not apply
    by: str
    seconds: float

    def __str__(self) -> str:
        return f"{self.verdict.upper():15} {self.mutant.name:45} {self.by} ({self.seconds:.0f}s)"


def mutants() -> list[Mutant]:
    found = []
    for patch in sorted(HERE.glob("*.patch")):
        head = patch.read_text().split("\ndiff --git", 1)[0].splitlines()
        what = next((line.removeprefix("Mutant:").strip() for line in head if line.startswith("Mutant:")), "")
        kills = tuple(tuple(shlex.split(line.removeprefix("Kill:"))) for line in head if line.startswith("Kill:"))
        found.append(Mutant(patch.stem, what, kills, patch))
    return found


def scratch_copy() -> Path:
    """The working tree's files as they are (tracked and new, not ignored), copied under /tmp; its symbolic links
    (outbox_pipeline/assets, outbox_pipeline/resources) stay links, into the copy."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    target = Path(tempfile.mkdtemp(prefix="outbox-mutant-"))
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            (target / name).symlink_to(source.readlink())
        elif source.is_file():
            shutil.copy2(source, target / name)
    return target


def _apply(mutant: Mutant, tree: Path) -> str | None:
    """None when the patch applied, else why not (git apply's own words)."""
    checked = subprocess.run(["git", "apply", "--check", str(mutant.patch)], cwd=tree, capture_output=True, text=True)
    if checked.returncode != 0:
        return checked.stderr.strip().splitlines()[0] if checked.stderr.strip() else "git apply --check failed"
    subprocess.run(["git", "apply", str(mutant.patch)], cwd=tree, check=True, capture_output=True)
    return None


def run_one(mutant: Mutant, log: Path) -> Outcome:
    started = time.monotonic()
    tree = scratch_copy()
    try:
        if (why := _apply(mutant, tree)) is not None:
            return Outcome(mutant, "does not apply", why, time.monotonic() - started)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        for args in mutant.kills:
            # Its own --basetemp: pytest prunes old numbered temp dirs, another session's among them (a server's data).
            basetemp = f"--basetemp={tree / '.pytest-tmp'}"
            command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", basetemp, *args]
            with log.open("a") as out:
                out.write(f"\n=== {mutant.name}: {' '.join(args)}\n")
                out.flush()
                try:
                    code = subprocess.run(
                        command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
                    ).returncode
                except subprocess.TimeoutExpired:
                    code = -1
            if code in (TESTS_FAILED, -1):  # -1: the command passed its timeout (a hang is a kill too)
                return Outcome(mutant, "killed", " ".join(args), time.monotonic() - started)
            if code != 0:  # pytest's own trouble (no test selected, a collection error): a broken kill line
                return Outcome(mutant, "error", f"{' '.join(args)}: pytest exit {code}", time.monotonic() - started)
        return Outcome(mutant, "survived", "every test named passed", time.monotonic() - started)
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__)
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and the tests aimed at each")
    parser.add_argument("--log", type=Path, default=Path(tempfile.gettempdir()) / "outbox-mutants.log")
    args = parser.parse_args(argv)
    chosen = [m for m in mutants() if not args.names or m.name in args.names]
    if unknown := set(args.names) - {m.name for m in chosen}:
        parser.error(f"no such mutant: {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n" + "".join(f"    kill: {' '.join(k)}\n" for k in m.kills), end="")
        return 0
    print(f"{len(chosen)} mutants, each in a scratch copy; pytest output in {args.log}", flush=True)
    outcomes = []
    for mutant in chosen:
        outcomes.append(run_one(mutant, args.log))
        print(outcomes[-1], flush=True)
    applied = [o for o in outcomes if o.verdict != "does not apply"]
    killed = sum(o.verdict == "killed" for o in applied)
    print(f"score: {killed}/{len(applied)} killed ({len(outcomes) - len(applied)} do not apply)")
    return 0 if killed == len(applied) else 1


if __name__ == "__main__":
    sys.exit(main())
