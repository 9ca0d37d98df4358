"""Engine, layer 6: the bulk drain's engine that the Spark executors call (plan, per-range publish, commit), with the
relay's publisher. Spark and Dagster are above it (assets/spark, orchestration): nothing here imports either.

May import: the top-level modules, `strategies`, `store`, `observe`, `relay`, `operate`.
"""
