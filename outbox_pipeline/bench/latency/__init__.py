"""`outbox bench --latency`: commit -> Kafka latency under steady traffic, writers and observer in processes of their
own (docs/performance.md). Each module: docs/architecture.md#commands."""
