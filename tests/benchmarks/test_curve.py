"""``benchmarks/bench_curve.py``: where a learning curve's served line would pass the best free baseline."""

import math

from benchmarks.bench_curve import crossings, slope


def test_the_crossing_is_where_the_fitted_line_reaches_what_choose_k_says_the_draft_needs():
    # the EAGLE-3 curve's served K=3 points (docs/log/2026-11-28-results-moved-off-the-page.md, BF16 CPU)
    points = [(300, 1.340), (1200, 1.460), (2400, 1.586)]
    a, b = slope(points)
    lines = {"eagle3/served/K3": {"intercept": a, "per_doubling": b, "points": 3}}
    rows = [{"experiment": "eagle3", "conversations": n, "served": {3: y}} for n, y in points]
    rows[-1]["to_pass"] = {"server": "suffix", "tokens_per_s": 74.3, "needs": {3: 1.75}}
    (found,) = crossings(rows, lines)
    assert (found["k"], found["free"], found["at"], found["has"], found["needs"]) == (3, "suffix", 2400, 1.586, 1.75)
    assert math.isclose(a + b * math.log2(found["conversations_to_pass"]), 1.75, abs_tol=1e-3)
    assert found["conversations_to_pass"] > 2400
    # one point has no line to extend
    alone = [{"experiment": "peagle", "conversations": 4800, "served": {3: 1.6},
              "to_pass": {"server": "ngram", "tokens_per_s": 30.0, "needs": {3: 1.7}}}]
    assert crossings(alone, {})[0]["conversations_to_pass"] is None
