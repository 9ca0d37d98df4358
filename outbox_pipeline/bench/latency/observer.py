"""The latency bench's observer process: one consumer stamping each message as `poll()` returns it, and measuring its
own fetch delay. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, Producer, TopicPartition

PROBES_PER_S = 5.0


@dataclass(frozen=True)
class ObserverPlan:
    bootstrap: str
    topic: str
    partitions: int
    out: str
    fetch_wait_ms: int
    probe_topic: str | None = None  # None: no probes (the idle window)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class ObserverHeader:
    """Besides the arrivals: duplicates seen, fetch requests sent, and per probe (ack time, ack -> poll in ms)."""

    duplicates: int
    fetch_requests: int
    lifetime_s: float
    probes: list[tuple[float, float]]


def _stdin_commands(commands: queue.Queue[str]) -> None:
    for line in sys.stdin:
        commands.put(line.strip())
    commands.put("stop")


def _probe(bootstrap: str, topic: str, acked: dict[bytes, float], stop: threading.Event) -> None:
    """Probe messages, each waited for in this thread so its acknowledgement is stamped when it comes."""
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
    while not stop.wait(1 / PROBES_PER_S):
        value = uuid.uuid4().bytes
        producer.produce(topic, value)
        if producer.flush(5) == 0:
            acked[value] = time.time()


def _consumer(plan: ObserverPlan, stats: dict[str, Any]) -> Consumer:
    """Assigned (never joined) to every partition of the topic and the probe topic; its statistics land in ``stats``."""
    consumer = Consumer(
        {
            "bootstrap.servers": plan.bootstrap,
            "group.id": f"bench-observer-{uuid.uuid4().hex}",  # never joined: assign() only
            "enable.auto.commit": False,
            "fetch.wait.max.ms": plan.fetch_wait_ms,
            "fetch.min.bytes": 1,
            "statistics.interval.ms": 1000,
            "stats_cb": lambda text: stats.update(json.loads(text)),
        }
    )
    assignment = [TopicPartition(plan.topic, p, OFFSET_BEGINNING) for p in range(plan.partitions)]
    if plan.probe_topic:
        assignment.append(TopicPartition(plan.probe_topic, 0, OFFSET_BEGINNING))
    consumer.list_topics(plan.topic, timeout=30)  # connected, metadata in hand
    consumer.assign(assignment)
    return consumer


@dataclass
class _Arrivals:
    """What has arrived so far: each message's first arrival time, how many came again, and each probe's arrival."""

    probe_topic: str | None
    arrived: dict[str, float] = field(default_factory=dict)
    probes: dict[bytes, float] = field(default_factory=dict)
    duplicates: int = 0

    def take(self, msg: Message, at: float) -> None:
        error = msg.error()
        if error is not None and error.code() != KafkaError._PARTITION_EOF:
            raise RuntimeError(f"observer: {error}")
        if error is not None:
            return
        if msg.topic() == self.probe_topic:
            self.probes[msg.value() or b""] = at
            return
        message_id = dict(msg.headers() or []).get("message_id")
        if not isinstance(message_id, bytes):
            return
        key = message_id.decode()
        if key in self.arrived:
            self.duplicates += 1
        else:
            self.arrived[key] = at


def _observe(consumer: Consumer, arrivals: _Arrivals, commands: queue.Queue[str]) -> None:
    """Poll one message at a time until ``stop``, answering each ``expect N`` as soon as N messages arrived."""
    expect: int | None = None
    stopping = False
    while not stopping:
        msg = consumer.poll(0.1)
        at = time.time()
        if msg is not None:
            arrivals.take(msg, at)
        while not commands.empty():
            command = commands.get().split()
            if command[:1] == ["expect"]:
                expect = int(command[1])
            stopping = stopping or command[:1] == ["stop"]
        if expect is not None and len(arrivals.arrived) >= expect:
            print(f"arrived {len(arrivals.arrived)}", flush=True)
            expect = None


def run(plan: ObserverPlan) -> None:
    started = time.time()
    stats: dict[str, Any] = {}
    consumer = _consumer(plan, stats)
    acked: dict[bytes, float] = {}
    commands: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_stdin_commands, args=(commands,), daemon=True).start()
    stop_probing = threading.Event()
    prober = threading.Thread(target=_probe, args=(plan.bootstrap, plan.probe_topic, acked, stop_probing), daemon=True)
    if plan.probe_topic:
        prober.start()
    print("ready", flush=True)
    arrivals = _Arrivals(plan.probe_topic)
    _observe(consumer, arrivals, commands)
    stop_probing.set()
    if plan.probe_topic:
        prober.join()
    consumer.close()
    fetches = sum(int(b.get("req", {}).get("Fetch", 0)) for b in stats.get("brokers", {}).values())
    delays = sorted((acked[v], 1000 * (arrivals.probes[v] - acked[v])) for v in acked if v in arrivals.probes)
    header = ObserverHeader(arrivals.duplicates, fetches, time.time() - started, delays)
    with open(plan.out, "w") as out:
        out.write(json.dumps(asdict(header)) + "\n")
        out.writelines(f"{mid}\t{at!r}\n" for mid, at in arrivals.arrived.items())


def read_output(path: str) -> tuple[ObserverHeader, dict[str, float]]:
    with open(path) as lines:
        raw = json.loads(next(lines))
        header = ObserverHeader(**{**raw, "probes": [(at, ms) for at, ms in raw["probes"]]})
        arrivals = {mid: float(at) for mid, at in (line.rstrip("\n").split("\t") for line in lines)}
    return header, arrivals


if __name__ == "__main__":
    raw = json.loads(sys.argv[1])
    run(ObserverPlan(**raw))
