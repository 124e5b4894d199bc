"""Pearson's goodness-of-fit test, shared by the sampler tests (test_sampling.py, test_engine.py)."""

import math

import torch


def chi_square_rejects(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> bool:
    """Pearson's goodness-of-fit test at p = 1e-3: do `counts` (V,) contradict `probs` (V,)?

    Categories expected fewer than `min_expected` times are pooled into one; a draw of a zero-probability
    category always rejects. The critical value is the Wilson-Hilferty approximation of the chi-square quantile.
    """
    counts, probs = counts.double(), probs.double()
    if bool((counts[probs == 0] > 0).any()):
        return True
    expected = probs * counts.sum()
    big = expected >= min_expected
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = len(expected) - 1
    z = 3.090  # standard normal quantile at 1 - 1e-3
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic > critical
