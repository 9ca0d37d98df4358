"""What is listening where, read from /proc/net (no tools needed)."""

from __future__ import annotations

from pathlib import Path

LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex)
V4_MAPPED = "0000000000000000FFFF0000"  # ::ffff:a.b.c.d in /proc/net/tcp6: a JVM's IPv4 listener (Kafka) shows there


def listening_hosts(port: int) -> set[str]:
    """Local addresses in LISTEN state on ``port``, from /proc/net/tcp{,6}; an IPv4-mapped IPv6 address as its IPv4
    one (the same socket reachable from the same hosts)."""
    hosts = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                hosts.add(address.removeprefix(V4_MAPPED))
    return hosts
