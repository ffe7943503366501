"""The Engine's link to the registry in this process: when the registry's calls run."""
from __future__ import annotations

from cluster.engine.time_model_link import ADD_EVERY, IDLE_DEFER, LocalTimeModelLink
from controller.samples import StepSample
from controller.time_model import TimeModel


class _Workers:
    actors = None

    def install_time_model(self, model: TimeModel) -> int:
        return model.version


def test_the_registry_waits_for_an_idle_spell_once_the_engine_has_had_one(monkeypatch):
    """Before any idle spell (offline loops never have one) the step loop hands the registry
    ADD_EVERY samples at a time; from the first one on, what waits goes in when idle, and the
    step loop hands it in only once IDLE_DEFER times as many wait (a server never idle)."""
    link = LocalTimeModelLink(4 * ADD_EVERY, TimeModel(1), [], _Workers())
    calls = []
    monkeypatch.setattr(link._registry, "add", lambda samples: calls.append(len(samples)))
    sample = StepSample(1, 1, 10, 1.0, 0, 0.0)
    for _ in range(ADD_EVERY + 10):
        link.record([sample])
    assert calls == [ADD_EVERY]
    link.idle()
    assert calls == [ADD_EVERY, 10]
    link.idle()  # nothing waits: no call
    assert calls == [ADD_EVERY, 10]
    for _ in range(ADD_EVERY * IDLE_DEFER - 1):
        link.record([sample])
    assert calls == [ADD_EVERY, 10]
    link.record([sample])
    assert calls == [ADD_EVERY, 10, ADD_EVERY * IDLE_DEFER]
