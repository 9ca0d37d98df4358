"""Engine, layer 5: what an operator does to a live outbox. Dead letters (retry, discard), rewinds and lease releases,
switching strategy, partition maintenance.

May import: the top-level modules, `strategies`, `store`, `observe`, `relay`.
"""
