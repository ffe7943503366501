"""The replica's CPU priority by load. Ray starts worker processes at niceness 15, the
replica included, while the engine actor asks for 0 (cluster/engine/ray_env.py). With one
request in flight that is right: the replica's polls and chunks take CPU from the engine
only when it blocks, and at 0 one client got 0.747 of offline throughput against 0.786 at
15. With many, the replica has tokenizing, adds and streams to serve while the engine holds
both cores: at 15, TTFT p50 was 281 ms at 64 clients and 100 ms at 16, against 244 and 69
at 0, at the same throughput (DESIGN.md section 5). So the replica runs at BUSY_NICENESS
while at least BUSY_AT requests are in flight, and at its starting niceness otherwise.
Lowering a niceness needs the right to (CAP_SYS_NICE): where it is refused the replica
stays as it is, and says so once.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("adaspec.priority")
BUSY_AT = 2  # requests in flight from which the replica runs at BUSY_NICENESS
BUSY_NICENESS = 0


def renice_process(niceness: int) -> None:
    """Every thread of this process at `niceness` (Linux sets it per thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except ProcessLookupError:  # the thread has ended since the listing
            pass


class LoadPriority:
    def __init__(self, idle: int | None = None, busy: int = BUSY_NICENESS, busy_at: int = BUSY_AT,
                 renice=renice_process):
        """idle: the niceness with fewer than busy_at requests in flight (default: the process's now)."""
        self.idle = os.getpriority(os.PRIO_PROCESS, 0) if idle is None else idle
        self.busy, self.busy_at, self._renice = busy, busy_at, renice
        self.current = self.idle
        self.enabled = renice is not renice_process or os.path.isdir("/proc/self/task")  # Linux: per-thread nice

    def update(self, in_flight: int) -> None:
        """Called whenever the number of requests in flight may have changed; renices on a change of state only."""
        want = self.busy if in_flight >= self.busy_at else self.idle
        if want == self.current or not self.enabled:
            return
        try:
            self._renice(want)
        except PermissionError:
            self.enabled = False
            log.warning("this replica may not lower its niceness to %d under load (no CAP_SYS_NICE): it stays at %d",
                        want, self.current)
            return
        self.current = want
