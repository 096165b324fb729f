"""The equalization solver's box-bounded L-BFGS against scipy's L-BFGS-B and known optima."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize, rosen, rosen_der

from pathir.equalization.lbfgs import minimize_box


def test_rosenbrock_unbounded_reaches_the_optimum():
    res = minimize_box(lambda x: (rosen(x), rosen_der(x)), np.full(10, -1.2), max_iter=3000, ftol=1e-16, gtol=1e-10)
    np.testing.assert_allclose(res.x, np.ones(10), atol=1e-5)


def test_rosenbrock_in_a_box_matches_scipy():
    x0 = np.full(12, 1.5)
    ours = minimize_box(lambda x: (rosen(x), rosen_der(x)), x0, -0.5, 0.8, max_iter=3000, ftol=1e-16, gtol=1e-10)
    ref = minimize(rosen, x0, jac=rosen_der, method="L-BFGS-B", bounds=[(-0.5, 0.8)] * 12,
                   options={"ftol": 1e-16, "gtol": 1e-10, "maxiter": 3000})
    assert ours.fun == pytest.approx(ref.fun, rel=1e-7)
    assert ours.x.min() >= -0.5 and ours.x.max() <= 0.8


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**31 - 1))
def test_bounded_convex_quadratic_meets_its_kkt_conditions(n, seed):
    """min ½xᵀAx − bᵀx over lo ≤ x ≤ hi (A positive definite): at the result every free coordinate has a
    zero gradient and every held one a gradient pointing out of the box, as the KKT conditions ask."""
    rng = np.random.default_rng(seed)
    M = rng.normal(size=(n, n))
    A = M @ M.T + 0.5 * np.eye(n)
    b = rng.normal(size=n) * 3
    lo, hi = -rng.uniform(0.1, 1, n), rng.uniform(0.1, 1, n)
    res = minimize_box(lambda x: (0.5 * x @ A @ x - b @ x, A @ x - b), np.zeros(n), lo, hi, max_iter=5000,
                       ftol=0.0, gtol=1e-9)
    g = A @ res.x - b
    free = (res.x > lo + 1e-9) & (res.x < hi - 1e-9)
    assert np.all(np.abs(g[free]) <= 1e-6)
    assert np.all(g[res.x <= lo + 1e-9] >= -1e-6) and np.all(g[res.x >= hi - 1e-9] <= 1e-6)
    assert np.all(res.x >= lo) and np.all(res.x <= hi)


def test_window_rule_stops_once_the_last_iterations_gain_less_than_atol_each():
    """On Rosenbrock (a slow, curved valley) the window rule stops a run that is still descending, well
    before the optimum that the run without it reaches."""
    x0 = np.full(10, -1.2)
    res = minimize_box(lambda x: (rosen(x), rosen_der(x)), x0, max_iter=3000, ftol=0.0, gtol=0.0, atol=1e-3, window=5)
    full = minimize_box(lambda x: (rosen(x), rosen_der(x)), x0, max_iter=3000, ftol=0.0, gtol=1e-10)
    assert "atol" in res.message and res.success
    assert res.nit < full.nit and full.fun <= res.fun < rosen(x0)
    again = minimize_box(lambda x: (rosen(x), rosen_der(x)), x0, max_iter=res.nit + 5, ftol=0.0, gtol=0.0)
    assert again.fun <= res.fun  # the same path, a little further: still lower (the rule stopped a live run)


@settings(max_examples=50, deadline=None)
@given(st.floats(-10, 10), st.floats(0.01, 100), st.floats(0.1, 100))
def test_a_cut_step_goes_to_the_quadratic_minimiser_kept_within_a_tenth_and_a_half(f0, descent, curvature):
    """On f(t) = f0 − descent·t + curvature·t² (the rejected step at t = 1) the cut is f's minimiser
    descent / (2·curvature), clipped to [0.1, 0.5]; a non-finite value halves the step."""
    from pathir.equalization.lbfgs import _cut

    f1 = f0 - descent + curvature
    want = min(0.5, max(0.1, descent / (2 * curvature)))
    assert _cut(f0, f1, -descent) == pytest.approx(want, rel=1e-9)
    assert _cut(f0, float("inf"), -descent) == 0.5 and _cut(f0, float("nan"), -descent) == 0.5
