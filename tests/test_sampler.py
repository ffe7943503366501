"""Hand-written acceptance cases with the outputs they must give (greedy and rejection
sampling), and the sampling distribution's top-k / top-p / temperature."""
from __future__ import annotations

import math

import pytest
import torch

from workers.plan import SamplingParams
from workers.sampler import argmax_rows, draft_top2, greedy_accept, probs_from_logits, rejection_accept

V = 6


def one_hot(*tokens: int) -> torch.Tensor:
    """(len(tokens), V) distributions each certain of its token."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


@pytest.mark.parametrize("drafts,target,accepted", [
    ([5, 6, 7], [5, 6, 9], 2),  # the third draft disagrees
    ([5, 6, 7], [5, 6, 7], 3),  # all agree
    ([5], [5], 1),  # only the first was verified
    ([5, 6, 7], [4, 6, 7], 0),  # the first disagrees: later agreement does not count
    ([], [], 0),  # nothing verified
])
def test_greedy_accept(drafts, target, accepted):
    assert greedy_accept(drafts, target) == accepted


SAMPLED = SamplingParams(temperature=1.0, seed=3)


def test_rejection_accepts_what_the_target_is_sure_of_and_adds_its_bonus():
    # drafts 1, 2 verified and certain under both; the target is certain of 4 after them
    accepted, out = rejection_accept([1, 2], one_hot(1, 2), one_hot(1, 2, 4), SAMPLED, start=10)
    assert (accepted, out) == (2, [1, 2, 4])


def test_rejection_replaces_a_draft_the_target_rules_out_from_the_residual():
    # draft 2 at position 11 has target probability 0: rejected; residual max(0, p - q) is p (certain of 5)
    accepted, out = rejection_accept([1, 2], one_hot(1, 2), one_hot(1, 5, 4), SAMPLED, start=10)
    assert (accepted, out) == (1, [1, 5])


def test_rejection_accepts_a_unsure_draft_the_target_is_sure_of():
    q = torch.full((1, V), 1.0 / V)  # the draft was a guess; p/q = V >= 1: always accepted
    accepted, out = rejection_accept([3], q, one_hot(3, 0), SAMPLED, start=0)
    assert (accepted, out) == (1, [3, 0])


def test_an_unverified_draft_decides_its_own_position():
    # one of two drafts verified; the second, drafted but not verified, takes the bonus position
    # by the same accept test (p certain of it), instead of a fresh sample from p
    accepted, out = rejection_accept([1, 2], one_hot(1, 2), one_hot(1, 2), SAMPLED, start=0)
    assert (accepted, out) == (1, [1, 2])
    accepted, out = rejection_accept([1, 2], one_hot(1, 2), torch.stack([one_hot(1)[0], one_hot(5)[0]]), SAMPLED,
                                     start=0)
    assert (accepted, out) == (1, [1, 5])  # rejected there: the residual (p, certain of 5) decides


def test_top_k_keeps_the_k_largest_renormalised():
    probs = probs_from_logits(torch.tensor([3.0, 2.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    e = math.e
    assert probs.tolist() == pytest.approx([e / (e + 1), 1 / (e + 1), 0.0, 0.0])


@pytest.mark.parametrize("top_p,expected", [(0.75, [0.625, 0.375, 0, 0]), (0.5, [1, 0, 0, 0]),
                                            (1.0, [0.5, 0.3, 0.15, 0.05])])
def test_top_p_keeps_the_smallest_set_that_reaches_p(top_p, expected):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert probs.tolist() == pytest.approx(expected)


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([1.0, 0.0])
    hot, cold = (probs_from_logits(logits, SamplingParams(temperature=t)) for t in (2.0, 0.5))
    assert hot[0].item() == pytest.approx(1 / (1 + math.exp(-0.5)))
    assert cold[0].item() == pytest.approx(1 / (1 + math.exp(-2.0)))


def test_draft_inputs_are_the_same_with_and_without_the_kernels(ops, monkeypatch):
    """The CPU kernel and torch's softmax and top-2 (the path on other devices) agree."""
    from models import kernels

    logits = torch.randn(5, 4096, generator=torch.Generator().manual_seed(0)) * 3
    logits[2, 100] = logits[2, 4000] = 30.0  # equal maxima

    def run():
        tokens, top, margin = torch.empty(5, dtype=torch.long), *torch.empty(2, 5, dtype=torch.float64)
        draft_top2(logits, tokens, top, margin)
        return tokens, top, margin, argmax_rows(logits)

    fast = run()
    monkeypatch.setattr(kernels, "ops_for", lambda *tensors: None)
    slow = run()
    assert fast[0].tolist() == slow[0].tolist() == fast[3] == slow[3]
    assert fast[0][2] == 100
    torch.testing.assert_close(fast[1], slow[1], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(fast[2], slow[2], rtol=1e-6, atol=1e-8)
