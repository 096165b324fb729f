"""GriddedLaplacian (pairs plus factored grids, rank one or rank k) against PairLaplacian on the same
pairs all materialised and merged (the definition), masses and z spanning beyond float64's range."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pathir.pairs import gridded_laplacian
from pathir.pairs.factored_grid import FactoredGrid
from pathir.pairs.gridded_laplacian import GriddedLaplacian
from pathir.pairs.pair_laplacian import PairLaplacian
from pathir.pairs.unit_pairs import Pairs, segment_logsumexp


def merged(parts: list[Pairs], H: int) -> Pairs:
    """The pairs of every part, one pair per distinct (enter, leave), masses summed in log space."""
    key = np.concatenate([p.enter * (H + 1) + p.leave for p in parts])
    log_mass = np.concatenate([p.log_mass for p in parts])
    order = np.argsort(key, kind="stable")
    sk = key[order]
    starts = np.flatnonzero(np.r_[True, sk[1:] != sk[:-1]])
    return Pairs(segment_logsumexp(log_mass[order], starts), sk[starts] // (H + 1), sk[starts] % (H + 1), H)


def _bounded_rows(rng, n: int, k: int) -> np.ndarray:
    rows = np.exp(rng.uniform(-228.0, 0.0, (n, k)))  # within 1e99
    return rows / rows.max(axis=1, keepdims=True)


@st.composite
def problems(draw):
    """Rest pairs (possibly none, linear masses or log only) and one to three grids over H units,
    some overlapping the rest's pairs; a z and a direction p."""
    H = draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.0, 1.0, 300.0]))
    keys = np.flatnonzero(rng.random((H + 1) ** 2) < draw(st.sampled_from([0.0, 0.3])))
    keys = keys[keys != H * (H + 1) + H]  # no (none, none) pair
    log_mass = rng.uniform(-spread, spread, keys.size)
    if draw(st.booleans()) and keys.size and np.ptp(log_mass) < 600:
        top = float(log_mass.max())
        rest = Pairs(None, keys // (H + 1), keys % (H + 1), H, mass=np.exp(log_mass - top), log_top=top)
    else:
        rest = Pairs(log_mass, keys // (H + 1), keys % (H + 1), H)
    grids = []
    for _ in range(draw(st.integers(1, 3))):
        enter = np.flatnonzero(rng.random(H + 1) < 0.6)
        leave = np.flatnonzero(rng.random(H) < 0.6)  # never (none, none)
        enter = enter if enter.size else np.array([0])
        leave = leave if leave.size else np.array([0])
        k = draw(st.sampled_from([0, 0, 2]))  # rank one, or rank-k rows within 1e99 (a 1×1 convolution)
        if k and grids and grids[-1].U is not None and draw(st.booleans()):  # |E| as the last: stacked
            enter = np.sort(rng.choice(H + 1, grids[-1].enter.size, replace=False))
            width = grids[-1].leave.size if draw(st.booleans()) else draw(st.integers(1, H))  # (else padded)
            leave = np.sort(rng.choice(H, width, replace=False))
        factors = () if not k else tuple(_bounded_rows(rng, n, k) for n in (enter.size, leave.size))
        grids.append(FactoredGrid(enter, leave, rng.uniform(-spread, spread, enter.size) + rng.normal() * spread,
                                  rng.uniform(-spread, spread, leave.size), H, *factors))
    z = rng.normal(size=H) * draw(st.sampled_from([0.0, 1.0, 200.0]))
    return rest, grids, z, rng.normal(size=H), rng.integers(0, 3, H + 1), rng.random(H + 1) < 0.7


@settings(derandomize=True, max_examples=200, deadline=None)
@given(problems(), st.booleans(), st.booleans())
def test_gridded_point_matches_the_materialised_pairs(problem, both, overlap):
    """Also with the pairs and the grids evaluated on two threads (forced below the size that turns it on)."""
    saved = gridded_laplacian.OVERLAP_CELLS
    gridded_laplacian.OVERLAP_CELLS = 0 if overlap else saved
    try:
        _matches_the_materialised_pairs(*problem, both)
    finally:
        gridded_laplacian.OVERLAP_CELLS = saved


def _matches_the_materialised_pairs(rest, grids, z, p, groups, keep, both):
    H = rest.num_units
    point = GriddedLaplacian(rest, tuple(grids)).point(z, both)
    reference = PairLaplacian(merged([rest] + [g.materialise() for g in grids], H)).point(z)
    assert math.isclose(point.log_e, reference.log_e, rel_tol=1e-12, abs_tol=1e-10)
    ratio = math.exp(point.log_e - reference.log_e) * reference.total / point.total  # reference scale / ours
    tiny = 1e-290
    np.testing.assert_allclose(point.inc * ratio, reference.inc, rtol=1e-10, atol=tiny)
    np.testing.assert_allclose(point.out * ratio, reference.out, rtol=1e-10, atol=tiny)
    np.testing.assert_allclose(point.self_terms() * ratio, reference.self_terms(), rtol=1e-10, atol=tiny)
    scale = reference.inc + reference.out
    assert np.all(np.abs(point.diag() * ratio - reference.diag()) <= 1e-10 * scale + tiny)
    assert np.all(np.abs(point.hessian_times(p) * ratio - reference.hessian_times(p))
                  <= 1e-10 * scale * np.abs(p).max() + tiny)
    mask = keep.astype(float)
    np.testing.assert_allclose(point.grouped(groups, 3, mask) * ratio, reference.grouped(groups, 3, mask),
                               rtol=1e-10, atol=tiny)


def test_grids_of_one_rank_and_near_widths_share_a_padded_stack():
    """Rank-k grids of one |E| whose |L| are within a factor of 2 are one stack (padded to the widest), a
    wider one starts another, and the stacked point is still the materialised pairs'."""
    from pathir.pairs.low_rank_grids import LowRankStack

    H, rng = 12, np.random.default_rng(5)
    grids = []
    for width in (3, 5, 6, 11):
        enter, leave = np.sort(rng.choice(H + 1, 4, replace=False)), np.sort(rng.choice(H, width, replace=False))
        grids.append(FactoredGrid(enter, leave, rng.uniform(-3, 3, 4), rng.uniform(-3, 3, width), H,
                                  _bounded_rows(rng, 4, 2), _bounded_rows(rng, width, 2)))
    rest = Pairs(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), H)
    stacks = [p for p in GriddedLaplacian(rest, tuple(grids)).parts if isinstance(p, LowRankStack)]
    assert sorted(len(s.grids) for s in stacks) == [1, 3]
    for z_scale in (0.0, 1.0, 200.0):
        _matches_the_materialised_pairs(rest, grids, rng.normal(size=H) * z_scale, rng.normal(size=H),
                                        rng.integers(0, 3, H + 1), rng.random(H + 1) < 0.7, False)
