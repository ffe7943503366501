"""What the draft budget expects of a draft position (DraftYields: the share of drafts made
there that the keep rule verified and that were accepted), and exploration: a rotating
share of sequences verifies everything, so the acceptance estimate also learns about the
drafts the rule passes over."""
from __future__ import annotations

import numpy as np

from controller.config import AdaptiveConfig, SpeculativeConfig
from controller.policy import SpecPolicy
from controller.step import EXPLORE_EVERY
from controller.time_model import TimeModel

N = 8
CONFIDENT = (0.9, 0.8)  # (top probability, margin) of the one confident sequence
UNSURE = (0.05, 0.001)  # ... and of the other seven
# validation is dear (0.5 ms a token against 1 ms a step): the rule verifies a draft only when
# its estimate is above about 0.7
MODEL = TimeModel(version=1, b0=1.0, b1=0.5, d0=1.0, d1=0.0)


def _run(unsure_rate: float, steps: int = 600) -> SpecPolicy:
    """One draft position per step; the confident draft is always accepted, the others at unsure_rate."""
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=1, adaptive=AdaptiveConfig(enabled=True)))
    policy.install(MODEL)
    policy.probes.hold()  # no probes: every step drafts the one position
    rng = np.random.default_rng(0)
    top = np.array([[CONFIDENT[0]]] + [[UNSURE[0]]] * (N - 1))
    margin = np.array([[CONFIDENT[1]]] + [[UNSURE[1]]] * (N - 1))
    for _ in range(steps):
        step = policy.begin_step("adaptive", np.full(N, 100), np.ones(N, dtype=np.int64), MODEL.version, 1)
        keep = np.array(step.keep(top, top, margin, None))
        right = np.concatenate([[1], rng.random(N - 1) < unsure_rate]).astype(np.int64)
        policy.end_step(step, top[:, :int(keep.max())], margin[:, :int(keep.max())], keep, np.minimum(keep, right))
    return policy


def test_the_budget_expects_what_drafting_brought_not_what_verified_drafts_did():
    """The rule verifies the confident draft alone, and it is always accepted; exploration
    verifies an unsure one in EXPLORE_EVERY. Counted over verified drafts a position looks
    like a sure thing; counted over the drafts made there it brings a seventh of a token for
    a quarter of a validated one, which does not pay for a draft step here."""
    policy = _run(unsure_rate=0.1)
    accepted, verified = policy.shares(N)
    explored = (N - 1) / N / EXPLORE_EVERY  # the share of drafts only exploration verified
    assert abs(verified[0] - (1 / N + explored)) < 0.03 and abs(accepted[0] - (1 / N + 0.1 * explored)) < 0.03
    step = policy.begin_step("adaptive", np.full(N, 100), np.ones(N, dtype=np.int64), MODEL.version, 1)
    assert step.budget == 0
    assert sum(step.keep(np.array([[UNSURE[0]]] * N), np.array([[UNSURE[0]]] * N), np.array([[UNSURE[1]]] * N),
                         None)) == len(range(-policy.adaptive_steps % EXPLORE_EVERY, N, EXPLORE_EVERY))


def test_exploration_teaches_the_estimate_about_drafts_the_rule_passes_over():
    """Seven drafts in eight look unsure (top probability 0.05) but are accepted 70% of the
    time. The rule starts out verifying none of them (0.5 said, 0.7 needed); only the
    rotating exploration verifies some, and from those the estimate learns 0.7."""
    policy = _run(unsure_rate=0.7)
    est = policy.logistic.estimate(np.array([[UNSURE[0]]]), np.array([[UNSURE[1]]]))[0, 0]
    assert abs(est - 0.7) < 0.08
    confident = policy.logistic.estimate(np.array([[CONFIDENT[0]]]), np.array([[CONFIDENT[1]]]))[0, 0]
    assert confident > 0.95


def test_the_counts_held_until_the_fold_are_per_position_counts_of_drafts_verified_and_accepted():
    """Steps' counts as given (a batch-1 list, a small batch's list, a large batch's array),
    counted into positions at the fold: at position j, the sequences that drafted, verified
    and got accepted more than j drafts (a sequence drafts at most its cap)."""
    from controller.yields import DraftYields
    yields = DraftYields(4)
    yields.count([3], 2, np.array([2]), np.array([1]))  # batch 1: 2 drafts made, both verified, one accepted
    yields.count([4, 1, 0], 3, np.array([3, 1, 0]), np.array([0, 1, 0]))  # caps 1 and 0 drafted less
    yields.count(np.array([4, 4]), 4, np.array([4, 2]), np.array([4, 2]))
    drafted, verified, accepted = yields.pending()
    assert drafted == [5, 4, 3, 2]  # > 0: 1 + 2 + 2; > 1: 1 + 1 + 2; > 2: 1 + 2; > 3: 2
    assert verified == [5, 4, 2, 1]
    assert accepted == [4, 2, 1, 1]
    yields.fold()
    assert yields.drafted.tolist() == [5, 4, 3, 2] and yields.accepted.tolist() == [4, 2, 1, 1]
    assert yields.pending() == [[], [], []]


def test_what_drafting_brings_is_counted_per_batch_size():
    """Steps of eight sequences, where the rule verified the confident draft alone, teach the
    budget of eight that a draft brings a seventh of a token. A step of one sequence (another
    bucket, no counts yet) still expects the prior: every draft verified, and accepted at the
    calibrated rate. Pooled, the counts of one batch size would stand for the other's."""
    from controller.yields import DraftYields, batch_bucket

    policy = _run(unsure_rate=0.1)
    accepted, verified = policy.shares(N)
    alone_accepted, alone_verified = policy.shares(1)
    assert (alone_accepted, alone_verified) == DraftYields(1).shares(policy._rates)
    assert alone_verified[0] == 1.0 and alone_accepted[0] > accepted[0] + 0.3
    assert policy.shares(5) == policy.shares(7) != policy.shares(8)  # buckets 4-7 and 8-15
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 127, 128, 10**4)] == [0, 1, 1, 2, 2, 3, 6, 7, 7]


def test_above_counts_the_values_past_each_position_on_both_paths():
    """above(values, m)[j] = how many values exceed j, for j < m: short lists count in Python,
    longer ones and arrays by a histogram; both give the brute-force counts."""
    from controller.decision import SMALL
    from controller.yields import above
    rng = np.random.default_rng(2)
    for n in (0, 1, 3, SMALL, SMALL + 1, 200):
        values = rng.integers(0, 9, n).tolist()
        for m in (0, 1, 4, 7, 12):
            expected = [sum(v > j for v in values) for j in range(m)]
            assert above(values, m) == expected and above(np.array(values, dtype=np.int64), m) == expected


def test_one_request_s_drafts_do_not_stand_batch_1_down():
    """Batch 1's steps are one request's at a time, so its bucket's first drafts are a request or
    two's. Here bucket 0 holds 100 first drafts accepted 45% (positions 1-3: 100 / 90 / 60 drafted,
    45 / 25 / 12 accepted) while the calibrator, pooled over every batch size, reads 0.8 at each
    position, and a draft step costs about half a plain step. Weighed against a prior of
    ALONE_PRIOR_WEIGHT drafts, that sample still leaves drafting worth it, so the bucket keeps
    counting (against 8, batch 1 stood down, and its probes, one position each, backed off);
    40 times as many drafts at that rate do stand it down."""
    from controller.one_row_step import OneRowStep

    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=3, adaptive=AdaptiveConfig(enabled=True)))
    tm = TimeModel(version=1, b0=1.0, b1=0.05, d0=0.55, d1=0.0)
    policy.install(tm)
    policy.probes.hold()
    policy.calibrator.hits[:, 0], policy.calibrator.trials[:, 0] = 800, 1000
    policy.cold = policy.cold_alone = False
    yields = policy.yields.of(1)

    def budget(scale: int):
        yields.drafted[:3] = [100 * scale, 90 * scale, 60 * scale]
        yields.verified[:] = yields.drafted
        yields.accepted[:3] = [45 * scale, 25 * scale, 12 * scale]
        policy._set_rates()  # as a calibration batch does
        return policy.begin_step("adaptive", [200], [3], tm.version, 3)

    drafts = budget(1)
    assert isinstance(drafts, OneRowStep) and drafts.best_m > 0
    assert budget(40).best_m == 0  # (a PlainStep: past batch 1's stand-down point)
