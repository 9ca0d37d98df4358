"""What the bulk bench measures ours against in the same invocation: the seed's own table and relay, a relay written
by hand, the produce-only and read-only ceilings (docs/performance.md). Each module: docs/architecture.md#commands."""
