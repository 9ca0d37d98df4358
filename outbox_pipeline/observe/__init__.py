"""Engine, layer 3: what an operator and the relay ask of the outbox. Who is alive (liveness), what is pending and why
(lag, the horizon), `outbox status`, the lag objective and the Prometheus metrics a relay worker serves.

May import: the top-level modules, `strategies`, `store`. The relay uses it (an `--until-empty` relay asks lag
whether it is done), so nothing here imports the relay.
"""
