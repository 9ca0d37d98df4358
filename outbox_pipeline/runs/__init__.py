"""Engine, layer 7: the units of relay work a Dagster run executes (a partition caught up, a long-lived stream), as
plain functions: orchestration/ calls them, and they import no Dagster.

May import: every engine layer below (`strategies` to `drain`).
"""
