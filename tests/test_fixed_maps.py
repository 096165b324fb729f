"""Resample, the separable fixed map: its arithmetic against the dense matrix it stands for,
|c|^q per axis, zero coefficients as no edges, channel ties, and the units through a
pixel shuffle (a Gather that joins r^2 channels into one)."""

import math
from dataclasses import replace

import numpy as np
import pytest

import pathir
from pathir.analyses.find_units import find_units
from pathir.backends.numpy import NumpyBackend
from pathir.backends.sympy import SympyBackend
from pathir.backends.torch import TorchBackend
from pathir.errors import GraphVerificationError
from pathir.ir import Conv, Dense, Gather, GraphBuilder, Resample, verify
from pathir.neurons.expand import count_edges, expand
from pathir.neurons.paths import enumerate_num_paths, enumerate_path_norm
from pathir.neurons.symbolic import verify_symbolic


def _mats(rng, shapes, zeros=0.3):
    return tuple(rng.choice([-1.0, 1.0], size=s) * rng.integers(1, 9, size=s) / 8 * (rng.random(s) > zeros)
                 for s in shapes)


def _dense(mats):
    """The matrix over flattened spatial positions the Resample stands for (Kronecker product)."""
    out = np.ones((1, 1))
    for a in mats:
        out = np.kron(out, a)
    return out


@pytest.mark.parametrize("shapes", [[(5, 3)], [(4, 2), (3, 5)], [(2, 3), (4, 1), (3, 3)]])
def test_resample_is_the_kronecker_product_on_every_backend(shapes):
    rng = np.random.default_rng(1)
    mats = _mats(rng, shapes)
    m = Resample(mats)
    in_shape = (2, *(s[1] for s in shapes))
    assert m.out_shape(in_shape) == (2, *(s[0] for s in shapes))
    x = rng.normal(size=(3, *in_shape))
    M = _dense(mats)
    want = np.einsum("pq,bcq->bcp", M, x.reshape(3, 2, -1)).reshape(3, *m.out_shape(in_shape))
    got = NumpyBackend().apply(m, x, in_shape)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(TorchBackend().to_numpy(TorchBackend().apply(m, TorchBackend().asarray(x), in_shape)),
                               want, rtol=1e-13, atol=1e-13)
    g = rng.normal(size=(3, *m.out_shape(in_shape)))
    adj = NumpyBackend().adjoint(m, g, in_shape)
    assert np.isclose((got * g).sum(), (adj * x).sum())
    exact = SympyBackend().apply(m, np.asarray(x[:1], dtype=object), in_shape)
    np.testing.assert_allclose(exact.astype(float), want[:1], rtol=1e-12)


def test_abs_power_per_axis_is_the_abs_power_of_every_coefficient_and_zero_stays_no_edge():
    rng = np.random.default_rng(2)
    m = Resample(_mats(rng, [(4, 3), (3, 4)]))
    for q in (0.5, 1, 2, 3):
        powered = m.with_weights(lambda w: np.abs(w) ** q)
        M = _dense(m.matrices)
        np.testing.assert_allclose(_dense(powered.matrices), np.where(M != 0, np.abs(M) ** q, 0), rtol=1e-13)
    ones = m.with_weights(np.ones_like)
    assert np.array_equal(_dense(ones.matrices), (_dense(m.matrices) != 0).astype(float))
    assert count_edges(m, (2, 3, 4)) == 2 * np.count_nonzero(_dense(m.matrices))


def test_verifier_checks_the_axis_lengths_and_finite_coefficients():
    b = GraphBuilder("r")
    x = b.input("x", (1, 3, 3))
    y = b.identity("y", [(x, Resample((np.ones((2, 3)), np.ones((2, 3)))))])
    verify(b.build(outputs=[y]))
    with pytest.raises(ValueError, match="axis 1"):
        Resample((np.ones((2, 3)), np.ones((2, 4)))).out_shape((1, 3, 3))
    g = b.build(outputs=[y])
    bad = g.replace_nodes([g.nodes[0], replace(g.nodes[1], edges=(replace(
        g.nodes[1].edges[0], map=Resample((np.full((2, 3), np.inf), np.ones((2, 3))))),))])
    with pytest.raises(GraphVerificationError, match="non-finite"):
        verify(bad)
    assert "resample[[2,3],[2,3]]" in str(g)


def _tiny(rng, zeros=0.4):
    b = GraphBuilder("tiny")
    x = b.input("x", (2, 3, 2))
    h = b.relu("h", [(x, Conv(b.param("c.w", rng.normal(size=(2, 2, 2, 1))), (1, 1), ((0, 0), (0, 0)), (1, 1)))],
               b.param("c.b", rng.normal(size=2)))
    r = b.relu("r", [(h, Resample(_mats(rng, [(3, 2), (3, 2)], zeros)))], b.param("r.b", rng.normal(size=2)))
    y = b.identity("y", [(r, Dense(b.param("d.w", rng.normal(size=(2, 18)))))])
    return b.build(outputs=[y])


def test_path_norms_and_counts_match_the_enumeration_with_signed_and_zero_coefficients():
    rng = np.random.default_rng(3)
    g = _tiny(rng)
    cm = pathir.compile(g)
    for q in (0.5, 1, 2):
        assert math.isclose(cm.path_norm(q), enumerate_path_norm(g, q), rel_tol=1e-12)
    assert round(cm.num_paths()) == enumerate_num_paths(g)
    net = expand(g)
    resample_edges = [e for e in net.edges(data=True) if e[2]["map"].value == "resample"]
    assert len(resample_edges) == 2 * np.count_nonzero(_dense(g.node("r").edges[0].map.matrices))
    assert all(d["weight"] != 0 and d["param"] is None for _, _, d in resample_edges)


def test_resample_keeps_channel_units_and_passes_the_symbolic_checks():
    g = _tiny(np.random.default_rng(4))
    _, units = find_units(g)
    # a fixed edge ties its ends (docs/math.md §5), within a channel: h's channel c with r's channel c
    assert [sorted(m) for m in units.members] == [[("h", 0), ("r", 0)], [("h", 1), ("r", 1)]]
    assert verify_symbolic(g).passed


def _shuffle_graph(rng):
    """conv (4 channels) -> relu -> pixel shuffle r = 2 (a Gather) -> conv (1 input channel)."""
    import torch
    import torch.nn.functional as F

    b = GraphBuilder("shuffle")
    x = b.input("x", (1, 2, 2))
    h = b.relu("h", [(x, Conv(b.param("c1.w", rng.normal(size=(4, 1, 1, 1))), (1, 1), ((0, 0),) * 2, (1, 1)))],
               b.param("c1.b", rng.normal(size=4)))
    ids = F.pixel_shuffle(torch.arange(16).reshape(1, 4, 2, 2), 2).reshape(-1).numpy()
    s = b.identity("s", [(h, Gather(ids, (1, 4, 4)))])
    y = b.identity("y", [(s, Conv(b.param("c2.w", rng.normal(size=(1, 1, 3, 3))), (1, 1), ((0, 0),) * 2, (1, 1)))])
    return b.build(outputs=[y])


def test_pixel_shuffle_ties_its_r2_channels_into_one_unit_and_a_finer_grouping_is_caught():
    g = _shuffle_graph(np.random.default_rng(5))
    _, units = find_units(g)
    assert len(units) == 1 and sorted(units.members[0]) == [("h", 0), ("h", 1), ("h", 2), ("h", 3), ("s", 0)]
    assert verify_symbolic(g).passed
    # too fine: each of h's channels its own unit, s's channel with h's channel 0
    split = np.arange(4)

    def renumbered(a):  # "no unit" is H: 1 before, 4 after
        return None if a is None else np.where(np.asarray(a) == len(units), 4, a)

    ends = []
    for p, (t, src) in zip(units.params, units.ends):
        if p.name in ("c1.w", "c1.b"):
            t = split.reshape(np.shape(t)) if np.size(t) == 4 else t
        ends.append((renumbered(t), renumbered(src)))
    channel_units = {name: renumbered(a) for name, a in units.channel_units.items()}
    fine = replace(units, count=4, channel_units={**channel_units, "h": split}, ends=tuple(ends))
    assert fine.members == ((("h", 0), ("s", 0)), (("h", 1),), (("h", 2),), (("h", 3),))
    report = verify_symbolic(g, units=fine)
    assert not report.passed and "rescaling_invariance" in {c.name for c in report.failed}
