"""The replica's niceness follows its load: its starting niceness with one request in
flight, BUSY_NICENESS from BUSY_AT on, changed only when the state changes; where lowering
it is refused, it stays as it is and says so once."""
from __future__ import annotations

import logging
import os

from cluster.serving.priority import BUSY_AT, BUSY_NICENESS, LoadPriority


def test_the_niceness_follows_the_requests_in_flight():
    calls = []
    priority = LoadPriority(idle=15, renice=calls.append)
    for in_flight in (0, 1, BUSY_AT, BUSY_AT + 5, BUSY_AT, 1, 0, 1, BUSY_AT):
        priority.update(in_flight)
    assert calls == [BUSY_NICENESS, 15, BUSY_NICENESS]
    assert priority.current == BUSY_NICENESS


def test_a_refused_renice_leaves_the_process_as_it_is(caplog):
    tries = []

    def refuse(niceness):
        tries.append(niceness)
        raise PermissionError("no CAP_SYS_NICE")

    priority = LoadPriority(idle=15, renice=refuse)
    with caplog.at_level(logging.WARNING, logger="adaspec.priority"):
        for in_flight in (BUSY_AT, 0, BUSY_AT, BUSY_AT + 1):
            priority.update(in_flight)
    assert tries == [BUSY_NICENESS] and priority.current == 15 and not priority.enabled
    assert caplog.text.count("CAP_SYS_NICE") == 1


def test_the_default_starts_at_this_process_s_niceness_and_renices_every_thread():
    now = os.getpriority(os.PRIO_PROCESS, 0)
    priority = LoadPriority(busy=now)  # renicing to where it is: allowed everywhere
    assert priority.idle == now and priority.current == now
    priority.update(BUSY_AT)
    assert os.getpriority(os.PRIO_PROCESS, 0) == now
