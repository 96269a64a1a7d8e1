"""Statistics the distribution tests share."""

from __future__ import annotations

from scipy.stats import chi2_contingency

from scheduler.offline import Completion


def same_token_distribution_p_value(plain: list[Completion], spec: list[Completion], position: int = 1) -> float:
    """Two-sample chi-square p-value that the token at `position` has one distribution in both groups.

    Tokens seen fewer than 20 times across both groups are pooled into one cell,
    so every expected count is >= 5.
    """
    tokens = sorted({c.token_ids[position] for c in plain + spec})
    table = [[sum(c.token_ids[position] == t for c in group) for t in tokens] for group in (plain, spec)]
    common = [j for j in range(len(tokens)) if table[0][j] + table[1][j] >= 20]
    rare = [j for j in range(len(tokens)) if j not in common]
    pooled = [[row[j] for j in common] + [sum(row[j] for j in rare)] for row in table]
    _, p_value, _, _ = chi2_contingency(pooled)
    return float(p_value)
