"""Adaptive pruning: target-exact greedy output, rank agreement through refits, and the
three mechanisms (pruning, early stop, draft budget) actually firing."""
from __future__ import annotations

import pytest

from cluster.engine.core import Engine
from cluster.engine.request import RequestParams
from controller.time_model import TimeModel
from tests.conftest import REFERENCE_TOKENS, greedy, local_engine, teach, tiny_config, token_ids

MAX_TOKENS = REFERENCE_TOKENS
ADAPTIVE = ("speculative.adaptive.enabled=true", "speculative.adaptive.profile_on_start=false",
            "speculative.num_speculative_tokens=7")
# Drafting cheap and each validated token a tenth of a step's fixed cost: at batch 8 drafting
# pays, and the least likely drafts do not pay their validation.
PRUNING_MODEL = TimeModel(b0=1.0, b1=0.1, b2=0.0, d0=0.05, d1=0.001)
# At 0.13 a token drafting could pay at batch 8 only were most drafts accepted: with 30% accepted
# (`_warm`) the budget stands down, and only the scheduled probes draft.
STAND_DOWN_MODEL = TimeModel(b0=1.0, b1=0.13, b2=0.0, d0=0.05, d1=0.001)


def _warm(engine: Engine, rate: float) -> None:
    """The engine's policy past its cold start (which would probe at every step), each draft
    position accepted at `rate` (conditional) in what it has seen."""
    policy = engine.workers.worker.runner.policy
    teach(policy, rate, 7)
    policy._flush()
    assert not policy.cold



@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_adaptive_greedy_equals_target_tp1(method, sharegpt_prompts, reference):
    engine = local_engine(tiny_config("parallel.tp_size=1", f"speculative.method={method}", *ADAPTIVE))
    try:
        engine.time_models.install(PRUNING_MODEL)
        assert token_ids(engine.generate(sharegpt_prompts, greedy(MAX_TOKENS))) == reference
        st = engine.stats
        assert st.verified < st.drafted, "the decision pruned nothing"
        assert st.accepted > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_adaptive_greedy_equals_target_tp2(method, ray_session, sharegpt_prompts, reference):
    engine = Engine(tiny_config("parallel.tp_size=2", f"speculative.method={method}", *ADAPTIVE))
    try:
        engine.time_models.install(PRUNING_MODEL)
        assert token_ids(engine.generate(sharegpt_prompts, greedy(MAX_TOKENS))) == reference
        assert engine.stats.verified < engine.stats.drafted
    finally:
        engine.shutdown()


@pytest.mark.parametrize("tp", [4, 16])
def test_ranks_agree_through_refits(tp, ray_session, sharegpt_prompts, reference):
    """digest_every=1: the Engine compares every rank's digest at every step; refits are
    forced between steps while requests are in flight."""
    n, tokens = (4, 16) if tp == 4 else (2, 6)
    engine = Engine(tiny_config(f"parallel.tp_size={tp}", "parallel.placement_strategy=PACK", "engine.digest_every=1",
                                "speculative.adaptive.refit_every=4", *ADAPTIVE))
    try:
        for p in sharegpt_prompts[:n]:
            engine.add_request(p, greedy(tokens))
        versions, done = set(), {}
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            if engine.stats.steps % 3 == 0:
                versions.add(engine.time_models.force_refit())
            versions.add(engine.time_model_version)
        assert len(versions) >= 2
        assert [done[f"req-{i}"] for i in range(n)] == [r[:tokens] for r in reference[:n]]
    finally:
        engine.shutdown()


def test_early_stop_skips_draft_steps(sharegpt_prompts, reference):
    engine = local_engine(tiny_config("parallel.tp_size=1", *ADAPTIVE))
    try:
        engine.time_models.install(PRUNING_MODEL)
        results = engine.generate(sharegpt_prompts, greedy(MAX_TOKENS))
        assert token_ids(results) == reference
        st = engine.stats
        full = 7 * sum(r[0].steps - 1 for r in results)  # drafted if every decode step ran k draft steps
        assert 0 < st.drafted < full
        assert st.draft_steps_run < 7 * st.decode_steps
    finally:
        engine.shutdown()


def test_batch_1_folds_the_early_stop_into_the_draft_kernel(sharegpt_prompts, reference, monkeypatch):
    """One greedy sequence at a time on the compiled OneRow: the draft loop makes each position's
    confidence inputs and its early stop with one call (OneRowStep.draft_next), which stops some
    steps short of their budget, and the tokens are the target's own."""
    from controller.one_row_step import OneRowStep

    answers, positions, made = [], [], OneRowStep.draft_next

    def counted(self):
        fused = made(self)
        if fused is None:
            return None

        def call(logits, tokens, inputs, j):
            answers.append(fused(logits, tokens, inputs, j))
            positions.append(j)
            return answers[-1]
        return call

    drafted, kept = [], OneRowStep.keep

    def keep(self, top_prob, *rest):  # the drafts the step made, after the fused calls it answered
        drafted.append((len(answers), top_prob.shape[1]))
        return kept(self, top_prob, *rest)

    monkeypatch.setattr(OneRowStep, "draft_next", counted)
    monkeypatch.setattr(OneRowStep, "keep", keep)
    engine = local_engine(tiny_config("parallel.tp_size=1", "engine.max_num_seqs=1", *ADAPTIVE))
    try:
        if engine.workers.worker.runner.policy.compiled is None:
            pytest.skip("the CPU kernels did not load")
        _warm(engine, 0.6)  # past batch 1's cold start, whose every step probes (no early stop)
        engine.time_models.install(PRUNING_MODEL)
        assert token_ids(engine.generate(sharegpt_prompts, greedy(MAX_TOKENS))) == reference
    finally:
        engine.shutdown()
    assert True in answers and False in answers
    # a stop ends its step's drafting: the step made the drafts up to the stop, no more
    prev, stopped = 0, []
    for calls, m in drafted:
        if calls > prev and not answers[calls - 1]:  # this step's last fused call said stop
            stopped.append((positions[calls - 1] + 1, m))
        prev = calls
    assert stopped and all(at == m for at, m in stopped)


def test_budget_turns_speculation_off_when_drafting_cannot_pay(sharegpt_prompts, reference):
    """A draft step that costs a second: no acceptance rate could make drafting pay, so no step
    drafts, past the cold start not even a probe, and the text is the target's."""
    engine = local_engine(tiny_config("parallel.tp_size=1", *ADAPTIVE))
    try:
        _warm(engine, 0.8)
        engine.time_models.install(TimeModel(b0=1.0, b1=0.01, b2=0.0, d0=1000.0, d1=0.0))
        assert token_ids(engine.generate(sharegpt_prompts, greedy(MAX_TOKENS))) == reference
        st = engine.stats
        assert st.decode_steps > 0 and st.zero_budget_steps == st.decode_steps and st.drafted == 0
    finally:
        engine.shutdown()


def test_a_probe_where_drafting_does_not_pay_drafts_for_one_row(sharegpt_prompts, reference):
    """Drafts accepted 30% of the time and each validated token 0.13 of a step's fixed cost: at
    batch 8 the budget stands down (drafting could pay only were most drafts accepted), and the
    scheduled probes draft for the one row exploration verifies, not for all 8 (the others would
    catch up on their whole history for drafts nobody verifies)."""
    engine = local_engine(tiny_config("parallel.tp_size=1", *ADAPTIVE))
    try:
        _warm(engine, 0.3)
        engine.time_models.install(STAND_DOWN_MODEL)
        last = len(sharegpt_prompts) - 1  # sampled; the first probe's exploration row
        for i, prompt in enumerate(sharegpt_prompts):
            engine.add_request(prompt, RequestParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1) if i == last
                               else greedy(MAX_TOKENS))
        done = {}
        while engine.has_work():
            done.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        assert [done[f"req-{i}"] for i in range(last)] == reference[:last]
        assert len(done[f"req-{last}"]) == MAX_TOKENS
        st = engine.stats
        assert st.zero_budget_steps > 0.8 * st.decode_steps  # all but the periodic probes
        probes = st.decode_steps - st.zero_budget_steps
        assert 0 < st.drafted <= probes and st.verified == st.drafted
        # and the registry learns the draft time of the one row that drafted, not of a batch of 8
        drafted = [s for s in engine.time_models.registry.online if s.draft_steps]
        assert drafted and all(s.draft_seqs == 1 < s.num_seqs for s in drafted)
    finally:
        engine.shutdown()


def test_registry_charges_drafting_with_its_early_stops_and_keep(tmp_path, sharegpt_prompts):
    """What a step's drafting cost, as the registry learns it, is its draft forwards plus the
    early stops and the keep decision (the trace's draft_ms is the forwards alone): a budget
    fitted on the forwards alone drafted where the decisions cost more than drafting brought."""
    import json

    trace = tmp_path / "steps.jsonl"
    engine = local_engine(tiny_config("parallel.tp_size=1", *ADAPTIVE, f"engine.trace_path={trace}"))
    policy, models = engine.workers.worker.runner.policy, {}  # every time model installed, by version
    install = policy.install

    def recorded(model):
        models[model.version] = model
        return install(model)

    policy.install = recorded
    try:
        engine.time_models.install(PRUNING_MODEL)
        for prompt in sharegpt_prompts[:4]:
            engine.add_request(prompt, greedy(24))
        while engine.has_work():
            engine.step()
        online = engine.time_models.registry.online
    finally:
        engine.shutdown()
    lines = [x for x, _ in _sampled([json.loads(line) for line in trace.read_text().splitlines()])]
    assert len(lines) == len(online) and [x["batch"] for x in lines] == [s.num_seqs for s in online]
    drafted = [(x, s) for x, s in zip(lines, online) if x["draft_steps"]]
    assert drafted
    for x, s in drafted:
        assert x["draft_ms"] < s.draft_ms <= x["draft_ms"] + x["control_ms"] + 1e-3
    # what the time model in force predicted for the draft, beside what it took
    assert all(x["predicted_draft_ms"] == round(models[x["version"]].draft_ms(x["draft_seqs"], x["draft_steps"]), 4)
               for x, _ in drafted)
    assert all(x["predicted_draft_ms"] == 0.0 for x in lines if not x["draft_steps"])


def _sampled(lines: list[dict]) -> list[tuple[dict, int]]:
    """The traced decode steps the registry gets, each with its `settling` mark: of each stretch
    that drafted, every DRAFT_SAMPLE_EVERY-th and every one that caught up on more than a steady
    step's tokens (every one while fewer than SAMPLE_ALL were sampled); of each stretch that
    drafted nothing its first PLAIN_RUN steps (a plain probe's stretch) and every
    PLAIN_SAMPLE_EVERY-th after them; a plain step among the first SETTLE_STEPS after a step
    that drafted is settling."""
    from cluster.engine.core import DRAFT_SAMPLE_EVERY, PLAIN_SAMPLE_EVERY, SAMPLE_ALL
    from controller.probes import PLAIN_RUN
    from controller.registry import STEADY_CATCHUP
    from controller.samples import SETTLE_STEPS

    out, run, drafting, drafted = [], 0, 0, False
    for x in lines:
        run, drafting = (0, drafting + 1) if x["draft_steps"] else (run + 1, 0)
        drafted |= bool(x["draft_steps"])
        if x["draft_steps"]:
            if len(out) < SAMPLE_ALL or x["catchup"] > STEADY_CATCHUP * x["draft_seqs"] or \
                    (drafting - 1) % DRAFT_SAMPLE_EVERY == 0:
                out.append((x, 0))
        elif run <= PLAIN_RUN or (run - 1) % PLAIN_SAMPLE_EVERY == 0:
            out.append((x, int(drafted and 0 < run <= SETTLE_STEPS)))
    return out


def test_which_decode_steps_the_registry_gets():
    """Every step that drafts until the registry has had SAMPLE_ALL samples; then, of a stretch
    that drafts, its first step and every DRAFT_SAMPLE_EVERY-th after, and any that first caught
    up on more than STEADY_CATCHUP tokens a drafting row (what the catch-up's cost is fitted on).
    Of a plain stretch: its first PLAIN_RUN, and every PLAIN_SAMPLE_EVERY-th counted from its first."""
    from types import SimpleNamespace

    from cluster.engine.core import DRAFT_SAMPLE_EVERY, PLAIN_SAMPLE_EVERY, SAMPLE_ALL, Engine
    from controller.probes import PLAIN_RUN
    from controller.registry import STEADY_CATCHUP

    engine = SimpleNamespace(_drafted=False, _plain_run=0, _draft_run=0, _sampled=0)
    assert all(Engine._samples(engine, 3, 4 * 2, 4) for _ in range(SAMPLE_ALL))
    assert engine._sampled == SAMPLE_ALL
    engine._draft_run = 0
    steady = [Engine._samples(engine, 3, 4 * 2, 4) for _ in range(2 * DRAFT_SAMPLE_EVERY + 1)]
    assert [i for i, s in enumerate(steady) if s] == [0, DRAFT_SAMPLE_EVERY, 2 * DRAFT_SAMPLE_EVERY]
    assert Engine._samples(engine, 3, 4 * STEADY_CATCHUP + 1, 4)  # a long catch-up mid-stretch ...
    assert not Engine._samples(engine, 3, 4 * STEADY_CATCHUP, 4)  # ... and the next, steady one
    plain = [Engine._samples(engine, 0) for _ in range(PLAIN_RUN + 2 * PLAIN_SAMPLE_EVERY)]
    sampled = [i for i, s in enumerate(plain) if s]
    assert sampled == list(range(PLAIN_RUN)) + [PLAIN_SAMPLE_EVERY, 2 * PLAIN_SAMPLE_EVERY]
    assert Engine._samples(engine, 1, 2, 1)  # a stretch that drafts starts over


def test_registry_samples_a_stretch_of_plain_steps(tmp_path, sharegpt_prompts):
    """Standing down, the registry gets the steps that drafted (the probes: `_sampled`), the first PLAIN_RUN
    plain steps after one (a plain probe's stretch goes in whole), and every PLAIN_SAMPLE_EVERY-th
    plain step of a longer stretch: each sample had cost its share of the registry's work and
    refits in the step loop (0.9% of batch 4's time standing down), and a plain step's time
    repeats itself. The first SETTLE_STEPS plain steps after a drafting one are marked settling
    (their validation is not plain decoding's: the registry leaves it out of the fit)."""
    import json

    trace = tmp_path / "steps.jsonl"
    engine = local_engine(tiny_config("parallel.tp_size=1", *ADAPTIVE, f"engine.trace_path={trace}"))
    try:
        _warm(engine, 0.3)
        engine.time_models.install(STAND_DOWN_MODEL)
        for prompt in sharegpt_prompts:
            engine.add_request(prompt, greedy(64))  # stretches longer than a plain probe's
        while engine.has_work():
            engine.step()
        online = engine.time_models.registry.online
    finally:
        engine.shutdown()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    sampled = _sampled(lines)
    assert [(s.num_seqs, s.draft_steps, s.settling) for s in online] == \
        [(x["batch"], x["draft_steps"], settling) for x, settling in sampled]
    assert any(x["draft_steps"] for x in lines)  # probes, each a sample
    assert any(s.settling for s in online) and not all(s.settling for s in online if not s.draft_steps)
    assert len(online) < 0.5 * len(lines)


def test_registry_leaves_one_offs_out_of_a_steps_rest_and_draft(sharegpt_prompts, monkeypatch):
    """A decode step whose end ran a calibration batch, and the step after one or after a new
    time model (which rebuilds what those made stale), say nothing about a steady step's rest:
    the registry gets their rest as 0 (not measured). The step after either drafts on caches
    they went through: its draft is marked a one-off, out of the draft fit. A cold start runs
    a calibration batch at every drafting step: counted, those steps had priced a drafting
    step's rest 0.4-2.1 ms above a plain one's and its draft at 1.3-1.9x the startup sweep's,
    where batch 1's steady steps ran at 1.0-1.07x."""
    import controller.policy

    monkeypatch.setattr(controller.policy, "OBSERVE_ROWS", 64)  # a calibration batch every 32 steps after cold
    engine = local_engine(tiny_config("parallel.tp_size=1", *ADAPTIVE))
    policy = engine.workers.worker.runner.policy
    try:
        engine.time_models.install(PRUNING_MODEL)
        for prompt in sharegpt_prompts:
            engine.add_request(prompt, greedy(96))
        # per decode step: (calibration batches after it, the time model it ran on, whether the registry got it:
        # of a stretch of plain steps it gets every PLAIN_SAMPLE_EVERY-th)
        marks = []
        while engine.has_work():
            before, steps = len(engine.time_models.registry.online), engine.stats.decode_steps
            engine.step()
            if engine.stats.decode_steps > steps:
                marks.append((policy.calibrations, engine.time_model_version,
                              len(engine.time_models.registry.online) > before))
                if len(marks) == 10:
                    engine.time_models.install(PRUNING_MODEL)  # a new version from the next step on
        online = engine.time_models.registry.online
    finally:
        engine.shutdown()
    recorded = [i for i, mark in enumerate(marks) if mark[2]]
    assert len(online) == len(recorded)
    draft = [i >= 2 and marks[i - 1][0] == marks[i - 2][0] and marks[i][1] == marks[i - 1][1]
             for i in range(len(marks))]
    rest = [ok and marks[i][0] == marks[i - 1][0] for i, ok in enumerate(draft)]
    assert [s.other_ms > 0 for s in online] == [rest[i] for i in recorded]
    assert [s.one_off == 0 for s in online] == [draft[i] for i in recorded]
    assert any(s.draft_steps and not s.one_off for s in online) and not all(rest) and rest != draft
    assert policy.calibrations > 2 and marks[-1][1] > marks[0][1]


def test_a_trace_line_says_how_long_the_engine_waited_since_its_last_step(tmp_path):
    """gap_ms: from the engine's previous step's end to this step's start (what a server's loop
    spends between steps, or its idle wait); t: when the step started."""
    import json
    import time

    began = time.time()
    trace = tmp_path / "steps.jsonl"
    engine = local_engine(tiny_config("parallel.tp_size=1", f"engine.trace_path={trace}"))
    try:
        engine.add_request(list(range(5, 25)), greedy(12))
        engine.step()  # the prefill
        waited = []
        while engine.has_work():
            waited.append(len(waited) % 2 == 1)
            if waited[-1]:
                time.sleep(0.03)
            engine.step()
    finally:
        engine.shutdown()
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    gaps = [line["gap_ms"] for line in lines]
    assert len(gaps) == len(waited) >= 4
    assert all((gap >= 30.0) == slept for gap, slept in zip(gaps, waited)), gaps
    # t: each step's start on the wall clock; from one step's start to the next, its step and the gap after it
    starts = [line["t"] for line in lines]
    assert abs(starts[0] - began) < 5.0
    for a, b, line in zip(starts, starts[1:], lines[1:]):
        assert (b - a) * 1e3 >= line["gap_ms"]
