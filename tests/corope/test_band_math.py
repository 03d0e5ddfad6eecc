"""experiments/corope_band_math.py: the polynomial band's scores and gradients (the formulas a
backward kernel would use) against autograd of the exact Co-RoPE scores, in float64."""

from experiments.corope_band_math import check


def test_band_formulas_converge_to_the_exact_gradients():
    exact = check(terms=12)
    assert all(err < 1e-13 for err in exact.values()), exact
    # too few terms: the truncation shows, so the comparison can tell a wrong formula
    short = check(terms=4)
    assert all(err > 1e-9 for err in short.values()), short
    assert short["g"] > 10 * short["scores"]  # the derivative's series converges a term later
