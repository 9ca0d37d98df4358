"""Engine room (benchmarks): `outbox bench --latency`, commit -> Kafka latency under steady traffic. Writers
(traffic.py) and the observer (observer.py) are processes of their own; steady.py runs one scenario, latency.py the
invocation, latency_report.py its table; gauges.py and relays.py measure and start what runs meanwhile."""
