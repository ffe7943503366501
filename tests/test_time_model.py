"""The validate-time model fit and the profile registry's refits."""
from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from controller.catchup import CATCHUP_MIN_SAMPLES, catchup_ms
from controller.probes import PLAIN_RUN
from controller.registry import (DRAFT_MIN_SAMPLES, PLAIN_MIN_SAMPLES, RECENT, SCHEDULE_MAX, SPEED_WINDOW,
                                 STEADY_CATCHUP, WINDOW, ProfileRegistry)
from controller.samples import SETTLE_STEPS, SampleColumns, StepSample
from controller.time_model import TimeModel, fit, other_fit, piecewise, piecewise_at
from controller.yields import batch_bucket


def _samples(rng, m, b=(2.0, 0.05, 1e-4), spikes=0, ns=()):
    """m steps of 1-32 sequences (ns: batch sizes to take in turn instead)."""
    out = []
    for i in range(m):
        n, q, ctx = rng.integers(1, 33), rng.integers(1, 9), rng.integers(16, 512)
        n = ns[i % len(ns)] if ns else n
        ms = b[0] + b[1] * n * q + b[2] * n * q * ctx
        ms *= 1 + rng.normal(0, 0.02)
        if i < spikes:
            ms *= 40  # a neighbour took the CPU
        out.append(StepSample(int(n), int(n * q), int(n * q * ctx), float(ms), 1, 0.5 + 0.01 * n))
    return out


def test_fit_recovers_coefficients_despite_spikes():
    rng = np.random.default_rng(0)
    data = _samples(rng, 80, spikes=6)
    rows = np.array([s.features() for s in data])
    report = fit(rows, np.array([s.validate_ms for s in data]), np.array([s.num_seqs for s in data], float),
                 np.array([s.draft_ms for s in data]), version=3)
    m = report.model
    assert m.version == 3 and report.samples <= 74
    assert abs(m.b0 - 2.0) < 0.3 and abs(m.b1 - 0.05) < 0.01 and abs(m.b2 - 1e-4) < 2e-5
    assert all(abs(m.draft_step_ms(n) - (0.5 + 0.01 * n)) < 0.02 for n in (1, 8, 32))
    assert report.mape < 0.05


def test_coefficients_are_never_negative():
    rows = np.array([[1.0, q, 0.0] for q in range(1, 20)])
    y = 10.0 - 0.1 * rows[:, 1]  # a falling line would need b1 < 0
    report = fit(rows, y, np.array([]), np.array([]), version=1)
    assert report.model.b1 == 0.0 and report.model.b0 > 0


def test_registry_refits_on_schedule_and_on_drift():
    rng = np.random.default_rng(1)
    reg = ProfileRegistry(refit_every=50, initial=TimeModel(version=1))
    reg.seed(_samples(rng, 40))
    assert reg.model.version == 2
    assert reg.add(_samples(rng, 49)) is None
    assert reg.add(_samples(rng, 1)).version == 3  # the 50th sample
    slow = _samples(rng, RECENT, b=(20.0, 0.5, 1e-3))  # the machine got 10x slower: refit before 50
    assert reg.add(slow).version == 4


def test_sample_columns_keep_the_last_window_in_order():
    rng = np.random.default_rng(3)
    data = _samples(rng, 8)
    ring = SampleColumns(size=5)
    for s in data:
        ring.append(s)
    assert len(ring) == 5 and ring.samples() == data[3:]
    assert SampleColumns(data[:2], size=5).samples() == data[:2] and SampleColumns().samples() == []


def test_sample_columns_extend_as_appended_one_by_one():
    """Blocks of any size, around the ring's end and longer than it, hold what the samples
    appended one at a time would."""
    rng = np.random.default_rng(8)
    data = _samples(rng, 60)
    ring, one = SampleColumns(size=7), SampleColumns(size=7)
    at = 0
    for size in (3, 5, 0, 9, 1, 7, 14, 2, 6, 13):
        ring.extend(data[at:at + size])
        for s in data[at:at + size]:
            one.append(s)
        at += size
        assert ring.count == one.count == at and ring.samples() == one.samples() == data[max(0, at - 7):at]


def test_scheduled_refits_back_off_while_they_change_nothing():
    """On a steady machine each scheduled refit gives the model it replaces (2 ms each, in
    an in-process rank's step loop): the wait doubles, up to SCHEDULE_MAX times refit_every.
    A change of regime brings a drift refit at once and the schedule back to refit_every."""
    rng = np.random.default_rng(9)
    reg = ProfileRegistry(refit_every=64, initial=TimeModel(version=1))
    reg.seed(_samples(rng, 200))
    refits, seen = [], 0
    for s in _samples(rng, 6000):
        seen += 1
        if reg.add([s]) is not None:
            refits.append(seen)
            if refits[-4:] == [seen - j * SCHEDULE_MAX * 64 for j in (3, 2, 1, 0)]:
                break  # the last three gaps at the cap
    gaps = np.diff([0] + refits).tolist()
    assert gaps[-3:] == [SCHEDULE_MAX * 64] * 3, gaps
    assert all(b in (a, 2 * a) for a, b in zip(gaps, gaps[1:])), gaps  # only ever doubling on a steady machine
    refits = []
    for i, s in enumerate(_samples(rng, 3000, b=(20.0, 0.5, 1e-3)), 1):
        if reg.add([s]) is not None:
            refits.append((i, reg.schedule))
    assert refits[0][0] == RECENT  # a drift refit at once (the robust fit does not follow the new regime yet)
    changed = next(i for i, schedule in refits if schedule == 64)  # once a refit moves the model ...
    assert next(i for i, _ in refits if i > changed) - changed <= 64  # ... the next comes within 64 again


def test_refit_reads_the_columns_as_the_samples_say():
    """A refit from the columns equals `fit` over the samples' own fields (the rule as written
    per sample: validated steps, steady draft steps at the rows that drafted, timed rests)."""
    rng = np.random.default_rng(4)
    sweep = _samples(rng, 30) + [StepSample(4, 0, 0, 0.0, 2, 1.1)]  # a sweep draft point
    online = []
    for i, s in enumerate(_samples(rng, 300)):
        online.append(s._replace(draft_steps=i % 3, draft_seqs=i % 4, catchup_tokens=(i * 7) % 90,
                                          other_ms=(i % 5) * 0.1, emitted=i % 6, draft_ms=0.3 + 0.01 * i))
    reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1), sweep=sweep)
    reg.add(online)
    speed = reg.sweep_speed()
    assert 0.9 < speed < 1.1  # the same model throughout; the sweep is rescaled by it all the same
    assert reg.draft_overhead(4) != 1.0  # online draft times over the sweep's, beyond speed, at 4 sequences
    # scaled as the registry scales them, one factor (speed * overhead at the row's batch size), or the last bit
    # may differ
    data = [s._replace(validate_ms=s.validate_ms * speed,
                       draft_ms=s.draft_ms * (speed * reg.draft_overhead(s.drafting))) for s in sweep] + online
    validated = [s for s in data if s.q_tokens > 0]
    steady = [s for s in data if s.draft_steps > 0 and s.catchup_tokens <= STEADY_CATCHUP * s.drafting]
    # rests: plain steps', and steady drafting steps' (there are at least DRAFT_MIN_SAMPLES of them here)
    timed = [s for s in data if s.other_ms > 0 and s.emitted > 0 and (s.draft_steps == 0 or s in steady)]
    assert sum(s.draft_steps > 0 for s in timed) >= DRAFT_MIN_SAMPLES
    expected = fit(np.array([s.features() for s in validated]), np.array([s.validate_ms for s in validated]),
                   np.array([s.drafting for s in steady], dtype=np.float64), np.array([s.draft_ms for s in steady]),
                   2, "linear", (np.array([s.emitted for s in timed], dtype=np.float64),
                                 np.array([s.other_ms for s in timed]),
                                 np.array([s.num_seqs if s.draft_steps > 0 else 0 for s in timed], dtype=np.float64)),
                   np.array([s.draft_steps for s in steady], dtype=np.float64))
    # the cost per catch-up token: from the online steps that drafted after a long catch-up
    behind = [s for s in online if s.draft_steps > 0 and s.catchup_tokens > STEADY_CATCHUP * s.drafting]
    assert len(behind) >= CATCHUP_MIN_SAMPLES
    per_token = catchup_ms(expected.model, *(np.array([getattr(s, f) for s in behind], dtype=np.float64)
                                             for f in ("drafting", "draft_steps", "catchup_tokens", "draft_ms")))
    expected = dataclasses.replace(expected, model=dataclasses.replace(expected.model, catchup_ms=per_token))
    assert reg.refit() == expected
    assert reg.online == online


def test_what_drafting_adds_to_a_steps_rest_waits_for_enough_steady_drafting_steps():
    """o2 (+ o3 n), what a drafting step's rest costs more, is fitted from steady drafting steps
    once there are DRAFT_MIN_SAMPLES of them, and kept as last measured while there are fewer: a
    server standing down drafts only its probes, after long catch-ups, with dearer rests."""
    rng = np.random.default_rng(11)
    sweep = _samples(rng, 30)

    def step(s: StepSample, n: int, drafts: bool, catchup: int, rest: float) -> StepSample:
        return s._replace(num_seqs=n, draft_steps=2 if drafts else 0, draft_ms=0.8 if drafts else 0.0,
                          catchup_tokens=catchup, emitted=3 if drafts else n, other_ms=rest)

    # a rest of 0.15 ms and 0.01 a token emitted; a drafting step's 0.02 more, a probe's 0.13 more
    plain = [step(s, 1 + i % 4, False, 0, 0.15 + 0.01 * (1 + i % 4)) for i, s in enumerate(_samples(rng, 200))]
    probes = [step(s, 1, True, 200, 0.15 + 0.03 + 0.13) for s in _samples(rng, DRAFT_MIN_SAMPLES + 8)]
    reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1), sweep=sweep)
    reg.add(plain + probes)  # drafting steps, but none steady: nothing measured yet
    model = reg.refit().model
    assert model.o2 == 0.0 and model.o3 == 0.0
    assert np.allclose([model.o0, model.o1], [0.15, 0.01], rtol=0.05)  # the plain steps' rest
    steady = [step(s, 1, True, 4, 0.15 + 0.03 + 0.02) for s in _samples(rng, DRAFT_MIN_SAMPLES)]
    reg.add(steady[:-1])
    assert reg.refit().model.o2 == 0.0  # one steady drafting step short
    reg.add(steady[-1:])
    measured = reg.refit().model
    assert np.isclose(measured.o2 + measured.o3, 0.02, atol=0.005)  # the steady ones' extra rest, not the probes'
    reg.add(plain * (WINDOW // len(plain) + 1) + probes)  # the window holds no steady drafting step any more
    kept = reg.refit().model
    assert (kept.o2, kept.o3) == (measured.o2, measured.o3)


def test_what_drafting_adds_to_the_validation_is_told_apart_and_outlives_the_window():
    """A step that drafted validates dearer than a plain one at the same tokens (the draft's
    forwards displace the target's weights): v_drafted is fitted beside f(Q), for both kinds,
    once the window holds DRAFT_MIN_SAMPLES steps of each kind; then kept while it holds too few
    drafting steps (a server standing down). Without the term, the fit put the extra into the
    per-token cost."""
    rng = np.random.default_rng(5)

    def step(n, q, drafts):
        kv = q * int(rng.integers(50, 400))
        ms = (1.0 + 0.1 * q + 1e-4 * kv + (0.2 if drafts else 0.0)) * (1 + rng.normal(0, 0.01))
        return StepSample(n, q, kv, ms, 2 if drafts else 0, 0.6 if drafts else 0.0, catchup_tokens=n)
    sweep = [step(n, n * q, False) for n in (1, 4, 16) for q in range(1, 9)]
    plain = [step(n, n, False) for n in rng.integers(1, 9, 300).tolist()]
    drafting = [step(n, n + int(rng.integers(0, 3 * n + 1)), True) for n in rng.integers(1, 9, 300).tolist()]
    for kind in ("linear", "table"):
        reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1), sweep=sweep, kind=kind)
        reg.add(plain + drafting[:DRAFT_MIN_SAMPLES - 1])
        assert reg.refit().model.v_drafted == 0.0  # one drafting step short
        reg.add(drafting)
        model = reg.refit().model
        assert abs(model.v_drafted - 0.2) < 0.03, (kind, model.v_drafted)
        assert abs(model.validate_ms_from(4, 800) - 1.48) < 0.05, kind  # the per-token cost is the sweep's
        assert np.isclose(model.drafting_extra_ms(4), model.o2 + 4 * model.o3 + model.v_drafted)
        reg.add(plain * (WINDOW // len(plain) + 1))  # the window holds no drafting step any more
        assert reg.refit().model.v_drafted == model.v_drafted, kind
        # a batch-1 step verifying three drafts costs 0.56 ms more than a plain one (0.36 its tokens, 0.2 drafting)
        more = model.validate_ms_from(4, 800, drafted=True) - model.validate_ms_from(1, 200)
        assert abs(more - 0.56) < 0.05, (kind, more)
    rows = plain + drafting
    blind = fit(np.array([[1.0, s.q_tokens, s.kv_tokens] for s in rows]), np.array([s.validate_ms for s in rows]),
                np.array([]), np.array([]), 0).model
    assert blind.v_drafted == 0.0  # no drafted column: the extra spreads over every step, and drafting looks cheap
    assert blind.validate_ms_from(4, 800) - blind.validate_ms_from(1, 200) < 0.45


def test_a_plain_step_is_priced_at_plain_decoding_s_cost_not_a_settling_one_s():
    """A batch that drafts has plain steps only from its plain probes' stretches; the first
    SETTLE_STEPS of each validate dearer (here 25%), the draft's forwards having displaced the
    target's weights. Marked as settling, they are left out of the validate fit and of the
    machine's speed: a plain step is priced at what the stretches' settled steps cost, and so
    is the sweep they rescale (the machine here runs 0.8x the sweep's time), which stays
    rescaled so once the window holds too few settled steps. Unmarked, the settling steps had
    priced a plain step well above plain decoding's cost."""
    rng = np.random.default_rng(11)

    def step(q, drafts, cost=1.0, settling=0):
        kv = q * int(rng.integers(50, 400))
        ms = cost * (1.0 + 0.1 * q + 1e-4 * kv + (0.2 if drafts else 0.0)) * (1 + rng.normal(0, 0.01))
        return StepSample(1, q, kv, ms, 3 if drafts else 0, 0.6 if drafts else 0.0, catchup_tokens=1,
                          settling=settling)
    sweep = [step(q, False) for q in range(1, 9) for _ in range(4)]
    online = []
    for _ in range(4):  # four plain probes' stretches among drafting steps
        online += [step(4, True, 0.8) for _ in range(200)]
        online += [step(1, False, 0.8 * 1.25, 1) for _ in range(SETTLE_STEPS)]
        online += [step(1, False, 0.8) for _ in range(PLAIN_RUN - SETTLE_STEPS)]
    assert (PLAIN_RUN - SETTLE_STEPS) * 4 >= PLAIN_MIN_SAMPLES
    for kind in ("linear", "table"):
        prices = {}
        for marked in (True, False):
            samples = online if marked else [x._replace(settling=0) for x in online]
            reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1), sweep=sweep, kind=kind)
            reg.add(samples)
            prices[marked] = reg.refit().model.validate_ms_from(1, 200) / (0.8 * 1.12)
            if marked:
                assert abs(reg.sweep_speed() - 0.8) < 0.02, kind
                reg.add([step(4, True, 0.8) for _ in range(WINDOW)])  # no plain step left in the window
                assert abs(reg.sweep_speed() - 0.8) < 0.02, kind  # as last measured, not the drafting steps'
                assert abs(reg.refit().model.validate_ms_from(1, 200) / (0.8 * 1.12) - 1.0) < 0.03, kind
        assert abs(prices[True] - 1.0) < 0.03 and prices[False] > 1.04, (kind, prices)


def test_a_fit_says_whether_it_has_priced_a_plain_step():
    """TimeModel.plain_measured: a fitted model is unmeasured (plain probes come more often,
    probes.py) until a refit finds PLAIN_MIN_SAMPLES settled plain steps in the window, and
    measured from then on, also once the window holds none (as the machine's speed for plain
    steps is kept); settling plain steps and drafting steps do not count. A hand-made model
    counts as measured."""
    def step(q, drafts, settling=0):
        return StepSample(1, q, 100 * q, 1.0 + 0.1 * q + (0.2 if drafts else 0.0), 3 if drafts else 0,
                          0.6 if drafts else 0.0, catchup_tokens=1, settling=settling)
    assert TimeModel().plain_measured
    sweep = [step(q, False) for q in range(1, 9) for _ in range(4)]
    reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1), sweep=sweep)
    assert not reg.refit().model.plain_measured  # the sweep alone
    reg.add([step(4, True) for _ in range(500)] + [step(1, False, settling=1) for _ in range(PLAIN_MIN_SAMPLES)])
    reg.add([step(1, False) for _ in range(PLAIN_MIN_SAMPLES - 1)])
    assert not reg.refit().model.plain_measured
    reg.add([step(1, False)])
    assert reg.refit().model.plain_measured
    reg.add([step(4, True) for _ in range(WINDOW)])  # no plain step left in the window
    assert reg.refit().model.plain_measured


def test_a_plain_step_s_rest_is_priced_at_settled_plain_steps_not_settling_ones():
    """The same for the rest of a step (o0 + o1 E): in an engine that drafts, its plain steps are
    mostly the first after drafting (at batch 1 every sequence's last step, which drafts
    nothing, some 45 for each plain probe's stretch, whose first steps settle too), and their
    rest runs dearer (here 0.10 ms against a settled 0.07). Left out as the validate fit leaves
    them out, a plain step's rest is what the settled ones cost; counted, it was priced at
    0.095 ms, plain decoding looking dearer than it is."""
    rng = np.random.default_rng(12)

    def step(drafts, rest, settling=0):
        emitted = 3 if drafts else 1
        return StepSample(1, 4 if drafts else 1, 800 if drafts else 200, 1.0, 3 if drafts else 0,
                          0.6 if drafts else 0.0, rest * (1 + rng.normal(0, 0.01)), emitted, catchup_tokens=1,
                          settling=settling)
    online = []
    for _ in range(4):  # per plain probe's stretch, 45 sequences' last steps (batch 1: 22 drafting steps each)
        for _ in range(45):
            online += [step(True, 0.15) for _ in range(22)] + [step(False, 0.10, 1)]
        online += [step(False, 0.10, 1) for _ in range(SETTLE_STEPS)]
        online += [step(False, 0.07) for _ in range(PLAIN_RUN - SETTLE_STEPS)]
    reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1))
    reg.add(online)
    model = reg.refit().model
    assert abs(model.other_ms(1) - 0.07) < 0.004, model.other_ms(1)
    assert abs(model.other_ms(3) + model.o2 - 0.15) < 0.01  # a drafting step's rest stays its own


def test_a_sweep_taken_at_a_slow_moment_is_rescaled_by_the_online_steps():
    """The sweep ran 2x slow, validate and draft alike; online, only plain steps came (standing
    down yields no draft steps). A drift refit comes after the first RECENT steps (the initial
    model's error is measured against its error on the sweep) and rescales the sweep: its draft
    step is the machine's of now, not twice it. Without the rescale the refit would keep 2x."""
    rng = np.random.default_rng(7)
    slow = [s._replace(validate_ms=2 * s.validate_ms, draft_steps=0, draft_ms=0.0)
            for s in _samples(rng, 40)]
    slow += [StepSample(n, 0, 0, 0.0, 1, 2 * (0.5 + 0.01 * n)) for n in (1, 4, 16, 64)]
    first = ProfileRegistry().seed(slow).model  # as the engine starts: the sweep's fit, then a registry on both
    assert abs(first.draft_step_ms(1) - 2 * 0.51) < 0.05
    reg = ProfileRegistry(refit_every=256, initial=first, sweep=slow)
    assert reg.sweep_speed() == 1.0  # no online steps yet
    plain = [s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, 64)]
    refits = [i for i, s in enumerate(plain, 1) if reg.add([s]) is not None]
    assert refits and refits[0] == RECENT  # the validate error (about 50%) calls a drift refit
    assert 0.45 < reg.sweep_speed() < 0.55
    assert abs(reg.model.draft_step_ms(1) - 0.51) < 0.05 and abs(reg.model.draft_step_ms(64) - 1.14) < 0.1
    assert abs(reg.model.b0 - 2.0) < 0.3 and abs(reg.model.b1 - 0.05) < 0.01


def test_drift_refits_back_off_while_they_do_not_cure_the_error():
    """A regime the fit cannot follow (the window is mostly the old one): drift refits come
    after 32, 64, 128 and then every refit_every samples, not every 32."""
    rng = np.random.default_rng(5)
    reg = ProfileRegistry(refit_every=256, initial=TimeModel(version=1))
    reg.seed(_samples(rng, 40))
    reg.add(_samples(rng, 2000))  # scheduled refits on the old regime
    start, refits = reg.model.version, []
    for i, s in enumerate(_samples(rng, 1000, b=(20.0, 0.5, 1e-3)), 1):
        if reg.add([s]) is not None:
            refits.append(i)
    gaps = np.diff([0] + refits).tolist()
    assert gaps[:4] == [RECENT, 2 * RECENT, 4 * RECENT, 256], gaps
    assert reg.model.version == start + len(refits)


def test_worker_keeps_the_version_plans_use_however_many_refits_arrive():
    """Refits may reach a rank faster than the Engine moves its plans (a slow poll, a
    rebuilt worker group): the version plans name is never dropped; older ones are."""
    import pytest

    from controller.config import SpeculativeConfig
    from controller.policy import SpecPolicy

    policy = SpecPolicy(SpeculativeConfig())
    policy.install(TimeModel(version=1))
    assert policy.model(1).version == 1
    for v in range(2, 12):
        policy.install(TimeModel(version=v))
    assert policy.model(1).version == 1  # still planned with
    assert policy.model(7).version == 7
    with pytest.raises(KeyError, match="version 1 is not on this rank"):
        policy.model(1)  # plans moved on: the old ones are gone
    assert sorted(policy.models) == list(range(7, 12))


def _concave_samples(rng, m):
    """A CPU's validate time: the cost per token falls as the step validates more."""
    out = []
    for _ in range(m):
        n, q, ctx = int(rng.integers(1, 33)), int(rng.integers(1, 9)), int(rng.integers(16, 512))
        Q = n * q
        ms = (3.0 + 1.2 * np.sqrt(Q - 1) + 2e-5 * Q * ctx) * (1 + rng.normal(0, 0.01))
        out.append(StepSample(n, Q, Q * ctx, float(ms), 1, 0.4 + 0.3 * np.sqrt(n)))
    return out


def test_table_follows_a_falling_cost_per_token_and_is_monotone():
    rng = np.random.default_rng(5)
    data = _concave_samples(rng, 200)
    rows = np.array([s.features() for s in data])
    val = np.array([s.validate_ms for s in data])
    draft_n = np.array([s.num_seqs for s in data], float)
    draft_ms = np.array([s.draft_ms for s in data])
    table = fit(rows, val, draft_n, draft_ms, 1, "table")
    linear = fit(rows, val, draft_n, draft_ms, 1, "linear")
    assert table.model.kind == "table" and linear.model.kind == "linear"
    assert table.mape < 0.03 < linear.mape
    q = np.arange(1, 600)
    f = table.model.q_ms_at(q)
    assert (np.diff(f) >= -1e-12).all()  # non-decreasing, extrapolated past the largest Q too
    for Q in (16, 64, 128):  # where the data lie
        assert abs(table.model.q_ms_at(Q) - (3.0 + 1.2 * np.sqrt(Q - 1))) < 0.05 * (3.0 + 1.2 * np.sqrt(Q - 1))
    assert abs(table.model.b2 - 2e-5) < 1e-5
    g = [table.model.draft_step_ms(n) for n in (1, 4, 16, 32)]
    assert all(abs(x - (0.4 + 0.3 * np.sqrt(n))) < 0.05 for x, n in zip(g, (1, 4, 16, 32)))
    reg = ProfileRegistry(sweep=data)
    held = reg.held_out_mape()
    assert held["table"] < 0.03 and held["table"] < held["linear"]


def test_unknown_kind_is_refused():
    import pytest

    with pytest.raises(ValueError, match="unknown time model kind 'cubic'"):
        fit(np.ones((4, 3)), np.ones(4), np.array([]), np.array([]), 1, "cubic")


def test_the_rest_of_a_step_is_fitted_from_online_steps():
    """Scheduling, sampling and bookkeeping: measured online, a line over tokens emitted."""
    rng = np.random.default_rng(7)
    reg = ProfileRegistry(refit_every=1000, initial=TimeModel(version=1))
    reg.seed(_samples(rng, 40))
    assert reg.model.other_ms(8) == 0.0  # the sweep does not measure it
    online = []
    for s in _samples(rng, 40):
        emitted = int(s.num_seqs * rng.uniform(1, 3))
        online.append(StepSample(s.num_seqs, s.q_tokens, s.kv_tokens, s.validate_ms, s.draft_steps, s.draft_ms,
                                 0.3 + 0.15 * emitted, emitted))
    reg.add(online)
    m = reg.refit().model
    assert abs(m.other_ms(1) - 0.45) < 0.01 and abs(m.other_ms(64) - 9.9) < 0.05


def test_what_a_drafting_step_costs_beyond_its_tokens_is_told_apart():
    """Plain steps at many batch sizes and drafting steps at a few: the rest is o0 + o1 E,
    plus o2 + o3 n where the step drafted; terms the steps cannot tell apart stay 0."""
    rng = np.random.default_rng(11)
    n = rng.integers(1, 33, 400).astype(np.float64)
    drafted = rng.random(400) < 0.3
    emitted = np.where(drafted, n * rng.uniform(1.2, 3.0, 400), n)
    ms = 0.12 + 0.01 * emitted + np.where(drafted, 0.05 + 0.02 * n, 0.0)
    ms[::50] *= 20  # a few timings a neighbour stole the CPU from
    o = other_fit(emitted, ms, np.where(drafted, n, 0.0))
    assert np.allclose(o, [0.12, 0.01, 0.05, 0.02], atol=1e-6), o
    assert np.allclose(other_fit(emitted, 0.12 + 0.01 * emitted), [0.12, 0.01, 0.0, 0.0])  # none drafted
    one = np.where(drafted, 4.0, 0.0)  # every drafting step at one batch size: o3 is not told apart
    o = other_fit(emitted, 0.12 + 0.01 * emitted + np.where(drafted, 0.13, 0.0), one)
    assert np.allclose(o, [0.12, 0.01, 0.13, 0.0], atol=1e-6), o


def _draft_law(n, m, scale=1.0):
    """A step's first draft position also catches the draft up on the accepted tokens."""
    return scale * (0.25 + m * (0.25 + 0.01 * n))


def test_the_first_draft_step_is_told_apart_and_the_engine_s_draft_cost_outlives_the_window():
    """Draft time is h(n) + m g(n). The sweep times one and k positions on their own, with
    the draft's weights in cache: 1.4x cheaper than online steps, which draft between the
    target's forwards, measure. Online steps drafting 1..5 times correct the model; then only
    plain steps come (the budget stood down) until the draft steps have left the window, and
    the model keeps the engine's draft cost (the overhead is remembered), for both kinds.
    Without it the refit went back to the sweep's 1.4x too cheap draft, and batch 8 drafted
    again."""
    rng = np.random.default_rng(3)
    # validate points at every batch size the draft points are at (as the startup sweep's): each draft step's
    # overhead is read against its own validate time over the sweep's fit, which a few random points at small
    # batches left 2-3x off there
    sweep = [s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, 30) + _samples(rng, 8, ns=(1, 2))]
    sweep += [StepSample(n, 0, 0, 0.0, m, _draft_law(n, m, 1 / 1.4), catchup_tokens=2 * n)
              for n in (1, 4, 16, 32) for m in (1, 5)]
    for kind in ("linear", "table"):
        reg = ProfileRegistry(refit_every=1000, initial=TimeModel(version=1), kind=kind)
        reg.seed(sweep)
        assert abs(reg.model.draft_ms(8, 3) - _draft_law(8, 3, 1 / 1.4)) < 0.05, kind
        online = []
        for s in _samples(rng, 200, ns=(1, 2, 3, 5, 8, 13, 21, 32)):
            m = int(rng.integers(1, 6))
            online.append(StepSample(s.num_seqs, s.q_tokens, s.kv_tokens, s.validate_ms, m,
                                     _draft_law(s.num_seqs, m), 0.3, s.num_seqs))
        # each batch-size bucket measures its own overhead: the premise holds in every one
        assert min(Counter(batch_bucket(s.num_seqs) for s in online[-SPEED_WINDOW:]).values()) >= DRAFT_MIN_SAMPLES
        reg.add(online)
        model = reg.refit().model
        assert all(abs(model.first_ms(n) - 0.25) < 0.03 for n in (1, 8, 32)), kind
        assert abs(model.draft_ms(8, 3) - _draft_law(8, 3)) < 0.05, kind
        assert model.draft_ms(8, 0) == 0.0
        reg.add([s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, WINDOW)])
        assert not any(s.draft_steps for s in reg.online)
        model = reg.refit().model
        assert all(abs(reg.draft_overhead(n) - 1.4) < 0.05 for n in (1, 8, 32)), kind
        assert abs(model.draft_ms(8, 3) - _draft_law(8, 3)) < 0.05, kind


def test_the_draft_overhead_sets_each_draft_step_against_its_own_validate_time():
    """The machine runs at 1.6x (slow) while the engine drafts, then 0.8x (fast) over the
    plain steps after it. Each draft step is 1.4x dearer than the sweep's beyond the machine's
    speed at that moment: the overhead is 1.4, read off the draft steps alone. Against the
    speed of the latest steps (the fast ones) it read 1.4 x 1.6 / 0.8 = 2.8, and the budget
    would stand down where drafting pays."""
    rng = np.random.default_rng(5)
    sweep = [s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, 30)]
    sweep += [StepSample(n, 0, 0, 0.0, m, _draft_law(n, m), catchup_tokens=2 * n)
              for n in (1, 4, 16, 32) for m in (1, 5)]
    reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1))
    reg.seed(sweep)
    slow, fast = 1.6, 0.8
    drafting = []
    for s in _samples(rng, 200):
        m = int(rng.integers(1, 6))
        drafting.append(StepSample(s.num_seqs, s.q_tokens, s.kv_tokens, slow * s.validate_ms, m,
                                   slow * 1.4 * _draft_law(s.num_seqs, m), 0.3, s.num_seqs))
    plain = [s._replace(validate_ms=fast * s.validate_ms, draft_steps=0, draft_ms=0.0)
             for s in _samples(rng, 600)]
    reg.add(drafting + plain)
    assert abs(reg.sweep_speed() - fast) < 0.05  # the latest steps: the fast stretch
    assert all(abs(reg.draft_overhead(n) - 1.4) < 0.05 for n in (8, 16))


def test_a_draft_that_first_caught_up_on_a_prompt_is_not_its_steady_cost():
    """After a prompt, or after steps that drafted nothing, the first draft forward catches up
    on hundreds of tokens. Those one-offs stay out of the draft fit (the budget expects the
    cost of drafting step after step). Where drafting rarely pays they are nearly all the points,
    too many for the robust fit to set aside as outliers."""
    rng = np.random.default_rng(4)
    reg = ProfileRegistry(refit_every=1000, initial=TimeModel(version=1))
    reg.seed(_samples(rng, 30))
    online = []
    for i, s in enumerate(_samples(rng, 300)):
        n, m = s.num_seqs, int(rng.integers(1, 4))
        long = i % 5 < 4  # four steps in five: a long catch-up, 0.01 ms a token
        catchup = n * int(rng.integers(50, 300)) if long else n * 3
        ms = 0.2 + m * (0.3 + 0.01 * n) + (0.01 * catchup if long else 0.0)
        online.append(StepSample(n, s.q_tokens, s.kv_tokens, s.validate_ms, m, ms, 0.3, n, catchup))
    reg.add(online)
    model = reg.refit().model
    assert abs(model.draft_ms(8, 2) - (0.2 + 2 * 0.38)) < 0.05


def test_a_probe_that_drafted_for_a_few_rows_is_fitted_at_their_count():
    """A probe standing down drafts for the explored rows alone (one in eight). Its draft
    time is for those rows: counted at the batch size it made drafting a batch of 32 look as
    cheap as drafting one sequence, and the budget drafted where it did not pay (the CPU
    validation's batch 8 fell to 0.82x plain decoding)."""
    rng = np.random.default_rng(5)
    for kind in ("linear", "table"):
        reg = ProfileRegistry(refit_every=1000, initial=TimeModel(version=1), kind=kind)
        reg.seed([s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, 30)])  # validations
        online = []
        for i, s in enumerate(_samples(rng, 300)):
            n, m = s.num_seqs, int(rng.integers(1, 4))
            rows = max(1, n // 8) if i % 2 else n  # every other step a probe for its explored rows
            online.append(StepSample(n, s.q_tokens, s.kv_tokens, s.validate_ms, m, 0.2 + m * (0.3 + 0.05 * rows),
                                     0.3, n, rows * 2, draft_seqs=rows))
        reg.add(online)
        model = reg.refit().model
        assert abs(model.draft_step_ms(32) - (0.3 + 0.05 * 32)) < 0.1, kind


def test_draft_time_is_fitted_per_batch_size_first_step_and_further_steps_apart():
    """h(n) + m g(n) with both tabled over n: batch 1's further draft step is priced by batch 1's
    steps. Online steps here as measured at n = 1, 4, 16, 64 (the first step's extra h grows
    with n, g is no line in n). One h for every n and g = d0 + d1 n priced batch 1's further
    step at 0.39 ms where it took 0.29, and the early stop stopped a position early."""
    h = {1: 0.21, 4: 0.26, 16: 1.05, 64: 2.26}
    g = {1: 0.29, 4: 0.54, 16: 1.29, 64: 2.92}
    rng = np.random.default_rng(5)
    online = []
    for _ in range(400):
        n, m = int(rng.choice(list(h))), int(rng.integers(1, 6))
        ms = (h[n] + m * g[n]) * (1 + rng.normal(0, 0.02))
        online.append(StepSample(n, n, n * 100, 1.0 + 0.1 * n, m, ms, 0.3, n))
    for kind in ("linear", "table"):
        reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1), kind=kind)
        reg.add(online)
        model = reg.refit().model
        for n in h:
            assert abs(model.draft_step_ms(n) - g[n]) < 0.02 * g[n] + 0.01, (kind, n)
            assert abs(model.first_ms(n) - h[n]) < 0.05 * h[n] + 0.02, (kind, n)
        assert model.draft_ms(2, 3) > model.draft_ms(1, 3)  # between the knots: interpolated, non-decreasing


def test_one_point_of_a_table_is_the_same_float_as_the_array_form():
    """piecewise_at (the per-step scalar path) gives exactly piecewise's value: between knots,
    on them, before the first and past the last (extrapolated), one knot or many."""
    rng = np.random.default_rng(11)
    for n_knots in (1, 2, 3, 7):
        knots = tuple(2 ** i for i in range(n_knots))
        values = tuple(np.cumsum(rng.uniform(0.01, 2.0, n_knots)).tolist())
        points = [0, 0.5, *knots, *rng.uniform(0, 3 * knots[-1], 200).tolist(), 10 * knots[-1]]
        for x in points:
            assert piecewise_at(x, knots, values) == float(piecewise(x, knots, values)), (n_knots, x)
    table = TimeModel(q_knots=(1, 2, 4, 8), q_ms=(1.0, 1.3, 1.9, 3.1), b2=1e-4, n_knots=(1, 2, 4), n_ms=(0.3, 0.35, 0.5),
                      h_ms=(0.1, 0.12, 0.2))
    for q in range(1, 40):
        assert table.validate_ms_from(q, 100 * q) == float(table.validate_ms_at(np.array([q]), np.array([100 * q]))[0])
        assert table.draft_ms(q, 3) == float(table.draft_ms_at(np.array([q]), np.array([3]))[0])


def _seeded_registry(rng) -> ProfileRegistry:
    """A registry seeded with a sweep of validate points (some at 1-2 sequences) and draft
    points at 1, 4, 16 and 32 sequences, drafting 1 and 5 positions at _draft_law."""
    sweep = [s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, 30) + _samples(rng, 8, ns=(1, 2))]
    sweep += [StepSample(n, 0, 0, 0.0, m, _draft_law(n, m), catchup_tokens=2 * n)
              for n in (1, 4, 16, 32) for m in (1, 5)]
    reg = ProfileRegistry(refit_every=10**6, initial=TimeModel(version=1))
    reg.seed(sweep)
    return reg


def test_a_batch_size_s_draft_overhead_does_not_price_another_s():
    """A served engine's warm-up at saturation drafts at 13-16 sequences, 1.9x dearer than the
    sweep beyond the machine's speed; then its load falls to one sequence. One overhead for
    every batch size priced batch 1's draft steps at 1.9x: batch 1 stood down, drafted no
    steady step of its own, and never measured its overhead. Per batch-size bucket, batch 1
    keeps the sweep's price until it measures its own (here the sweep's); 32 sequences, not
    measured, take the nearest measured bucket below (16's)."""
    rng = np.random.default_rng(6)
    reg = _seeded_registry(rng)
    warm = []
    for s in _samples(rng, 100, ns=(13, 14, 15, 16)):
        m = int(rng.integers(1, 6))
        warm.append(StepSample(s.num_seqs, s.q_tokens, s.kv_tokens, s.validate_ms, m,
                               1.9 * _draft_law(s.num_seqs, m), 0.3, s.num_seqs))
    reg.add(warm + [s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, 600, ns=(1,))])
    model = reg.refit().model
    assert abs(reg.draft_overhead(16) - 1.9) < 0.05 and abs(reg.draft_overhead(32) - 1.9) < 0.05
    assert reg.draft_overhead(1) == reg.draft_overhead(4) == 1.0
    assert abs(model.draft_ms(1, 3) - _draft_law(1, 3)) < 0.05 * _draft_law(1, 3)
    # more steady draft steps at batch 1 than the overhead's window holds, after the warm-up's: each bucket
    # reads its own latest steps
    ones = []
    for s in _samples(rng, 600, ns=(1,)):
        m = int(rng.integers(1, 6))
        ones.append(StepSample(1, s.q_tokens, s.kv_tokens, s.validate_ms, m, _draft_law(1, m), 0.3, 1))
    fresh = _seeded_registry(np.random.default_rng(6))
    fresh.add(warm + ones)
    assert abs(fresh.draft_overhead(16) - 1.9) < 0.05 and abs(fresh.draft_overhead(1) - 1.0) < 0.05
    # batch 1 drafts steadily (at the sweep's price here): its own overhead, remembered once plain steps follow
    own = []
    for s in _samples(rng, 40, ns=(1,)):
        m = int(rng.integers(1, 6))
        own.append(StepSample(1, s.q_tokens, s.kv_tokens, s.validate_ms, m, 1.2 * _draft_law(1, m), 0.3, 1))
    reg.add(own)
    reg.refit()
    reg.add([s._replace(draft_steps=0, draft_ms=0.0) for s in _samples(rng, WINDOW, ns=(1,))])
    assert not any(s.draft_steps for s in reg.online)
    assert abs(reg.draft_overhead(1) - 1.2) < 0.05 and abs(reg.draft_overhead(2) - 1.2) < 0.05
    assert abs(reg.draft_overhead(16) - 1.9) < 0.05


def test_a_draft_right_after_a_one_off_is_not_its_steady_cost():
    """Draft steps that ran right after a calibration batch (one_off: a cold start has one at
    every drafting step) ran 1.3-1.9x dearer than steady ones: neither the overhead nor the
    draft fit reads them."""
    rng = np.random.default_rng(7)
    reg = _seeded_registry(rng)
    online = []
    for i, s in enumerate(_samples(rng, 300, ns=(1, 2, 5, 8))):
        m, one_off = int(rng.integers(1, 6)), int(i % 3 != 0)
        online.append(StepSample(s.num_seqs, s.q_tokens, s.kv_tokens, s.validate_ms, m,
                                 (1.9 if one_off else 1.0) * _draft_law(s.num_seqs, m), 0.3, s.num_seqs,
                                 one_off=one_off))
    reg.add(online)
    model = reg.refit().model
    assert all(abs(reg.draft_overhead(n) - 1.0) < 0.05 for n in (1, 2, 5, 8))
    assert all(abs(model.draft_ms(n, 3) - _draft_law(n, 3)) < 0.05 * _draft_law(n, 3) for n in (1, 2, 5, 8))


def test_drift_refits_that_change_nothing_back_off_past_refit_every():
    """At batch 1 the recent error crossed its bar on noise now and then: drift refits came
    every 128-256 steps and nearly all of them (12 of 15 refits in three rounds, 5 ms each in
    the step loop) gave the model they replaced. A drift refit that changes no prediction is
    followed by one twice as late, up to SCHEDULE_MAX times refit_every, whatever the error
    did in between; a refit that moves the model brings the wait back to RECENT."""
    rng = np.random.default_rng(11)
    reg = ProfileRegistry(refit_every=64, initial=TimeModel(version=1))
    reg.seed(_samples(rng, 200))
    reg.add(_samples(rng, 1000))  # a fit on the steady machine
    drifts, seen = [], 0
    for block in range(160):  # one block of RECENT steps in four is noisy (+-40%): its error crosses the bar
        for s in _samples(rng, RECENT):
            if block % 4 == 3:
                s = s._replace(validate_ms=s.validate_ms * float(np.clip(1 + rng.normal(0, 0.4), 0.3, 3)))
            seen += 1
            scheduled = reg.since_fit + 1 >= reg.schedule
            if reg.add([s]) is not None and not scheduled:
                drifts.append(seen)
    gaps = np.diff(drifts).tolist()
    assert 3 <= len(drifts) <= 6 and gaps[-1] >= SCHEDULE_MAX * 64 // 2, gaps  # backed off (had come every 128: 31)
    assert reg.drift_wait == SCHEDULE_MAX * 64
    # the machine got 10x slower: the robust fit leaves the new steps out until they fill half the window (no drift
    # refit could follow sooner); the first refit that moves the model brings the wait back to RECENT
    b0 = reg.model.b0
    for s in _samples(rng, WINDOW, b=(20.0, 0.5, 1e-3)):
        if reg.add([s]) is not None and reg.model.b0 > 1.1 * b0:
            break
    assert reg.model.b0 > 1.1 * b0 and reg.drift_wait == RECENT
