"""The latency bench's writer and observer processes and the lines they say, each in a process of its own so none shares
a GIL with the relay. See docs/performance.md#how-the-latency-bench-measures."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Mapping


class Child:
    def __init__(self, module: str, plan: str, env: Mapping[str, str] | None = None) -> None:
        self.name = module.rsplit(".", 1)[-1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, plan],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def say(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def wait_line(self, prefix: str, timeout_s: float) -> str | None:
        """The child's next line starting with ``prefix``; None if it did not say it within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                raise RuntimeError(f"bench {self.name} exited with {self.process.wait()} (see its output above)")
            if line.startswith(prefix):
                return line
        return None

    def finish(self, timeout_s: float) -> None:
        """Until it exits (after ``stop`` or its schedule); killed if it has not within ``timeout_s``."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"bench {self.name} did not finish within {timeout_s:.0f} s") from None
        if code != 0:
            raise RuntimeError(f"bench {self.name} exited with {code} (see its output above)")

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def sleep_until(at: float) -> None:
    """Pacing: the bench reads its gauges at fixed times of the schedule."""
    pause = at - time.time()
    if pause > 0:
        time.sleep(pause)
