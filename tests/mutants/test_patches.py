"""Every mutant still applies to the code as it is: a change that moves the code a patch mutates fails here, in
`make test`, so the patch is rewritten with the change instead of being found dead at the nightly mutation run."""

from __future__ import annotations

import subprocess

import pytest

from tests.mutants.__main__ import ROOT, Mutant, mutants


@pytest.mark.parametrize("mutant", mutants(), ids=lambda m: m.name)
def test_the_mutant_applies_to_the_tree_and_names_the_tests_that_kill_it(mutant: Mutant) -> None:
    checked = subprocess.run(
        ["git", "apply", "--check", str(mutant.patch)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, f"{mutant.patch.name} no longer applies: rewrite it\n{checked.stderr}"
    assert mutant.what and mutant.kills, f"{mutant.patch.name}: a Mutant: line and at least one Kill: line"
