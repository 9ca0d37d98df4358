"""Mutation runs (docs/faults.md): realistic engine defects, one patch each, that the harness and the fault suite
must kill. ``python -m tests.mutants`` (``make test-mutants``) applies each to a scratch copy of the tree and runs
the tests its patch names."""
