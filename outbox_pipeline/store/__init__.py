"""Engine, layer 2 of the package (docs/architecture.md, "Layout"): the outbox in PostgreSQL. What a row is (messages,
its headers' and topic's rules, the record it becomes and its size), how services write it (`enqueue`, the SQL
writers' routing, trace context), and the schema it lives in (migrations, indexes, partition counts, the recorded
strategy and what a relay checks before reading as one).

May import: the package's top-level modules (config, settings, errors, server, timestamps, partitioning) and
`strategies` (each strategy's tables and indexes are part of the schema). Nothing above.
"""
