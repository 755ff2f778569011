"""The corpus figures (graphguard/engine/fidelity.py): zero for a path against itself, KL and
top-1 that see a changed distribution, and a refusal to compare scores of different texts."""

from __future__ import annotations

import math

import pytest
import torch

from graphguard.engine.fidelity import Scored, compare, corpus_text


def scored(logits: torch.Tensor, targets: list[int]) -> Scored:
    return Scored(torch.log_softmax(logits, dim=-1), torch.tensor(targets))


def test_a_path_against_itself_scores_zero() -> None:
    path = scored(torch.randn(6, 10), [1, 2, 3, 4, 5, 6])
    figures = compare(path, path)
    assert figures.positions == 6 and figures.kl == 0.0 and figures.top1 == 1.0
    assert figures.logprob_diff == 0.0 and figures.nll_diff == 0.0


def test_the_figures_measure_a_changed_distribution() -> None:
    reference = scored(torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]]), [0, 1])
    # the first position now prefers token 1; the second is unchanged
    path = scored(torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]]), [0, 1])
    figures = compare(reference, path)
    p = torch.softmax(torch.tensor([2.0, 0.0, 0.0]), dim=-1)
    expected_kl = float(
        (p * (p.log() - torch.log_softmax(torch.tensor([0.0, 2.0, 0.0]), -1))).sum()
    )
    assert math.isclose(figures.kl, expected_kl / 2, rel_tol=1e-5)
    assert figures.top1 == 0.5
    assert math.isclose(figures.nll_diff, 2.0 / 2, rel_tol=1e-5)  # token 0 lost 2 nats at one
    assert math.isclose(figures.logprob_diff, figures.nll_diff, rel_tol=1e-6)


def test_scores_of_different_texts_are_refused() -> None:
    with pytest.raises(ValueError, match="different texts"):
        compare(scored(torch.randn(2, 4), [0, 1]), scored(torch.randn(2, 4), [0, 2]))


def test_the_corpus_ships_with_the_package() -> None:
    text = corpus_text()
    assert len(text.split()) > 2000 and text.isascii()
