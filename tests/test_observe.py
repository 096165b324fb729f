"""pathir.observe and `pathir observe`: per-sample tables from arrays, tensors and DataLoaders."""

import json

import numpy as np
import pytest
import torch

import pathir
from pathir.app.cli import main


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))


@pytest.fixture(scope="module")
def data():
    return np.random.default_rng(0).normal(size=(10, 1, 6, 6))


def test_observe_streams_arrays_tensors_and_loaders_alike(data):
    cm = pathir.compile(_net(), input_shape=(1, 6, 6))
    a = pathir.observe(cm, data, qs=(1, 2), batch_size=4)
    b = pathir.observe(cm, torch.tensor(data), qs=(1, 2), batch_size=3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(data), torch.zeros(10)), batch_size=4)
    c = pathir.observe(cm, loader, qs=(1, 2), progress=True)
    for other in (b, c):
        for k, v in a.columns.items():
            assert np.allclose(other.columns[k], v, rtol=1e-12)
    assert np.allclose(10 ** a.columns["log10_active_l2"], cm.active_path_norm(data, q=2), rtol=1e-10)
    assert np.allclose(a.columns["log10_active_paths"], cm.active_path_counts(data), rtol=1e-12)
    assert np.all(a.columns["log10_active_l1"] <= a.global_values["log10_path_norm_l1"] + 1e-12)
    rows = a.to_csv().splitlines()
    assert len(rows) == 11 and rows[0].startswith("sample,")
    d = a.to_dict()
    assert d["samples"] == 10 and d["quantiles"]["log10_active_l1"]["0.5"] == pytest.approx(np.median(a.columns["log10_active_l1"]))


def test_observe_compare_bounds_hold(data):
    net = _net()
    cm = pathir.compile(net, input_shape=(1, 6, 6))
    masked = cm.graph.map_params(lambda p: p.with_value(np.where(np.abs(p.value) < 0.2, 0.0, p.value)))
    obs = pathir.observe(cm.graph, data, compare=masked)
    shared = obs.columns["shared"] == 1
    assert np.all(obs.columns["output_change"][shared] <= obs.columns["local_bound"][shared] * (1 + 1e-9))
    assert np.all(obs.columns["output_change"] <= obs.columns["global_bound"] * (1 + 1e-9))
    assert np.all(obs.columns["local_bound"][shared] <= obs.columns["global_bound"][shared] * (1 + 1e-9))


def test_cli_observe(tmp_path, monkeypatch, data, capsys):
    (tmp_path / "tinynet.py").write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),\n"
        "        torch.nn.Flatten(), torch.nn.Linear(12, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))\n")
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "x.npy", data)
    net = _net(3)
    torch.save(net.state_dict(), tmp_path / "w.pt")
    assert main(["observe", "tinynet:make", "--inputs", "x.npy", "--weights", "w.pt", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = pathir.compile(net, input_shape=(1, 6, 6)).active_path_norm(data, log10=True)
    assert np.allclose(out["columns"]["log10_active_l1"], want, rtol=1e-12)
    assert main(["observe", "tinynet:make", "--inputs", "x.npy", "--csv", "--q", "1", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "sample,log10_active_l1,log10_active_l2,log10_active_paths,active_fraction"
    assert main(["observe", "tinynet:make", "--inputs", "missing.npy"]) == 2


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(batch_size):
    from pathir.errors import ArgumentError

    cm = pathir.compile(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
                        input_shape=(3,))
    with pytest.raises(ArgumentError, match="batch_size"):
        pathir.observe(cm, np.zeros((5, 3)), batch_size=batch_size)


def test_a_shuffled_loader_is_refused_its_rows_would_name_no_sample(data):
    """Single process: the rows came in the shuffled order, numbered 0..N-1 as if in data set order."""
    cm, x = pathir.compile(_net(), input_shape=(1, 6, 6)), data
    dataset = torch.utils.data.TensorDataset(torch.as_tensor(x))
    shuffled = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    with pytest.raises(pathir.ArgumentError, match="this DataLoader's RandomSampler may reorder the samples"):
        pathir.observe(cm, shuffled)
    ordered = pathir.observe(cm, torch.utils.data.DataLoader(dataset, batch_size=4))
    np.testing.assert_array_equal(ordered.columns["log10_active_l1"], pathir.observe(cm, x).columns["log10_active_l1"])


class _Reversed(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


@pytest.mark.parametrize("sampler", ["distributed", "custom", "batch_sampler"])
def test_a_loader_that_reorders_or_shards_outside_a_process_group_is_refused(data, sampler):
    """A DistributedSampler with no process group (shuffled: 7 of 11 rows held another sample's numbers; with
    num_replicas=2 six samples numbered 0-5) and custom samplers were read as if in data set order."""
    cm, x = pathir.compile(_net(), input_shape=(1, 6, 6)), data
    dataset = torch.utils.data.TensorDataset(torch.as_tensor(x))
    n = len(dataset)
    if sampler == "distributed":
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=4, sampler=torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0))
        match = "a DistributedSampler outside a torch.distributed process group"
    elif sampler == "custom":
        loader, match = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=_Reversed(n)), "_Reversed may reorder"
    else:
        batches = torch.utils.data.BatchSampler(_Reversed(n), batch_size=4, drop_last=False)
        loader, match = torch.utils.data.DataLoader(dataset, batch_sampler=batches), "_Reversed may reorder"
    with pytest.raises(pathir.ArgumentError, match=match):
        pathir.observe(cm, loader)


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(3, 4), torch.nn.Linear(2, 4), torch.nn.Linear(4, 2)

    def forward(self, x, y):
        return self.c(torch.relu(self.a(x) + self.b(y)))


def test_a_dict_of_inputs_is_observed_in_batches_as_the_direct_queries_read_it():
    """observe iterated the dict's keys and refused it with 'pass a dict {input name: array}'."""
    torch.manual_seed(0)
    cm = pathir.compile(_TwoInputs().double(), input_shape=[(3,), (2,)])
    rng = np.random.default_rng(0)
    d = {"x": rng.normal(size=(7, 3)), "y": rng.normal(size=(7, 2))}
    obs = pathir.observe(cm, d, batch_size=3)
    assert len(obs) == 7
    np.testing.assert_allclose(obs.columns["log10_active_l1"], np.log10(cm.active_path_norm(d)), rtol=1e-12)
    with pytest.raises(pathir.errors.InputShapeError, match="all of the same N"):
        pathir.observe(cm, {"x": d["x"], "y": d["y"][:5]})


def test_forward_names_a_missing_or_unknown_input_and_a_batch_mismatch():
    """{"x": x} alone gave BackendError(KeyError 'y'); an extra key was ignored; batches 5 and 4 a raw torch error."""
    cm = pathir.compile(_TwoInputs().double(), input_shape=[(3,), (2,)])
    x, y = np.zeros((5, 3)), np.zeros((5, 2))
    for d, match in (({"x": x}, "no value for \\['y'\\]"), ({"x": x, "y": y, "typo": y}, "\\['typo'\\] name no input"),
                     ({"x": x, "y": y[:4]}, "different batch sizes")):
        with pytest.raises(pathir.errors.InputShapeError, match=match):
            cm.forward(d)
    assert cm.forward({"x": x, "y": y}).shape == (5, 2)


def test_quantiles_of_a_column_holding_minus_inf():
    """Samples with no active path (all-zero inputs, no biases) have log10 = -inf: numpy's interpolation gave nan
    for the quantiles among them (the docstring says nan only for nan entries); they are -inf, the rest as numpy."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.ReLU(), torch.nn.Linear(4, 2, bias=False))
    cm = pathir.compile(net, input_shape=(3,))
    x = np.concatenate([np.zeros((2, 3)), np.random.default_rng(0).normal(size=(6, 3))])
    obs = pathir.observe(cm, x)
    col = np.asarray(obs.columns["log10_active_l1"])
    assert np.isneginf(col[:2]).all() and np.isfinite(col[2:]).any()
    qs = obs.quantiles()["log10_active_l1"]
    ordered = np.sort(col)
    for q, value in qs.items():
        pos = q * (col.size - 1)
        lo = ordered[int(np.floor(pos))]
        if lo == -np.inf:
            assert value == -np.inf, q
        else:
            finite = ordered[np.isfinite(ordered)]
            assert value == pytest.approx(np.quantile(ordered, q)) and finite.min() <= value <= finite.max(), q
    for bad in ((-0.5,), (1.5,), (0.5, float("nan"))):  # negative positions wrapped around; > 1 an IndexError
        with pytest.raises(pathir.errors.ArgumentError, match=r"in \[0, 1\]"):
            obs.quantiles(bad)


def test_a_quantile_between_minus_and_plus_inf_has_no_value():
    from pathir.observe import _quantile

    both = np.array([-np.inf, np.inf])
    assert _quantile(both, 0.0) == -np.inf and _quantile(both, 1.0) == np.inf and np.isnan(_quantile(both, 0.9))
    ordered = np.array([-np.inf, 1.0, 2.0, np.inf])
    assert [_quantile(ordered, q) for q in (0.0, 0.2, 1 / 3, 0.5, 0.8, 1.0)] == [-np.inf, -np.inf, 1.0, 1.5, np.inf,
                                                                                 np.inf]


def test_an_empty_input_gives_every_column_empty():
    """No sample: the table has its columns (the same names as with samples), each of length 0, and nan quantiles."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    for kw in ({}, {"compare": cm}):
        empty, full = pathir.observe(cm, np.zeros((0, 3)), **kw), pathir.observe(cm, np.ones((2, 3)), **kw)
        assert len(empty) == 0 and list(empty.columns) == list(full.columns)
        assert all(v.shape == (0,) for v in empty.columns.values())
        assert all(np.isnan(q) for d in empty.quantiles().values() for q in d.values())


def test_a_list_of_single_samples_is_refused_with_the_hint_to_stack_them():
    """A list is a sequence of batches: one of single samples (no batch axis) is refused, saying to stack them;
    stacked, the same rows give the table."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    rows = list(np.random.default_rng(0).normal(size=(4, 3)))
    with pytest.raises(pathir.InputShapeError, match=r"got \(3,\); observe reads a list .*np\.stack"):
        pathir.observe(cm, rows)
    batches = [np.stack(rows[:2]), np.stack(rows[2:])]
    assert np.allclose(pathir.observe(cm, batches).columns["log10_active_l1"],
                       pathir.observe(cm, np.stack(rows)).columns["log10_active_l1"], rtol=1e-12)


def test_lists_written_as_python_lists_and_a_single_q_are_read_as_meant():
    """X.tolist() (rows as lists of numbers) gets the stack-them hint (it was cut to each row's first number:
    'got ()'); batches written as nested lists are batches (each was read as an (x, y) pair: its first row
    alone); qs=2 and quantiles(qs=0.5) take one number (a TypeError before)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    X = np.random.default_rng(1).normal(size=(7, 3))
    with pytest.raises(pathir.InputShapeError, match=r"got \(3,\); observe reads a list .*np\.stack"):
        pathir.observe(cm, X.tolist())
    whole = pathir.observe(cm, X, qs=2)
    nested = pathir.observe(cm, [X[:3].tolist(), X[3:].tolist()], qs=(2,))
    assert np.array_equal(nested.columns["log10_active_l2"], whole.columns["log10_active_l2"])
    assert np.allclose(10 ** whole.columns["log10_active_l2"], cm.active_path_norm(X, q=2), rtol=1e-12)
    assert list(whole.quantiles(qs=0.5)["log10_active_l2"]) == [0.5]


def test_rows_of_numpy_numbers_get_the_hint_to_stack_them():
    """[list(r) for r in X] holds numpy floats, which have a shape (()): each row was read as an (x, y) pair and
    cut to its first number ('got ()', no hint)."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    X = np.random.default_rng(2).normal(size=(5, 3))
    with pytest.raises(pathir.InputShapeError, match=r"got \(3,\); observe reads a list .*np\.stack"):
        pathir.observe(cm, [list(r) for r in X])


def test_a_q_given_twice_is_one_column_and_two_q_of_one_name_are_refused():
    """qs=(1, 1.0) appended every batch to the column twice (10 rows for 5 samples: row k was not sample k, and
    to_csv raised an IndexError); qs=(2, 2.0000001) wrote both into the column 'log10_active_l2'."""
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).double()
    cm = pathir.compile(net, input_shape=(3,))
    X = np.random.default_rng(3).normal(size=(5, 3))
    twice = pathir.observe(cm, X, qs=(1, 1.0), batch_size=2)
    assert len(twice) == 5 and list(twice.columns["log10_active_l1"].shape) == [5]
    assert np.allclose(10 ** twice.columns["log10_active_l1"], cm.active_path_norm(X, q=1), rtol=1e-12)
    assert twice.to_csv().count("\n") == 6
    with pytest.raises(pathir.ArgumentError, match="2.0000001.*log10_active_l2"):
        pathir.observe(cm, X, qs=(2, 2.0000001))


@pytest.mark.parametrize("inputs, error, says", [
    (None, pathir.ArgumentError, "got NoneType"), (3.0, pathir.ArgumentError, "got float"),
    (torch.empty(5, 1, 6, 6, device="meta"), pathir.InputShapeError, "meta device"),
    (np.zeros((0, 7)), pathir.InputShapeError, r"expects samples of shape \(1, 6, 6\)")])
def test_inputs_that_hold_no_samples_of_the_model_are_refused_by_name(inputs, error, says):
    """Raw TypeErrors and a meta tensor's RuntimeError; an empty array of the wrong shape returned 0 rows (review)."""
    cm = pathir.compile(_net(), input_shape=(1, 6, 6))
    with pytest.raises(error, match=says):
        pathir.observe(cm, inputs)


def test_distributed_is_none_or_false():
    cm = pathir.compile(_net(), input_shape=(1, 6, 6))
    with pytest.raises(pathir.ArgumentError, match="distributed must be None"):
        pathir.observe(cm, np.zeros((2, 1, 6, 6)), distributed=True)
    assert len(pathir.observe(cm, np.zeros((2, 1, 6, 6)), distributed=False)) == 2


def test_the_default_walk_size_bounds_the_feature_maps_and_a_loaders_batches_are_cut_to_it():
    """observe walked 32 samples at once whatever the model: densenet121 at 64×64 held 2.4 GB where 0.06 GB were
    live (memory review). The default now keeps a walk's feature maps within WALK_BYTES; a loader's larger
    batches are walked in such parts, with the same table."""
    from pathir.lifting.active import MAX_WALK, WALK_BYTES, walk_size

    big = torch.nn.Sequential(torch.nn.Conv2d(1, 256, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(256 * 64 * 64, 2))
    graph = pathir.compile(big, input_shape=(1, 64, 64)).graph
    per_sample = 8 * sum(int(np.prod(n.shape)) for n in graph.nodes)
    assert walk_size(graph) == WALK_BYTES // per_sample < MAX_WALK and walk_size(graph, 3) == 3
    cm = pathir.compile(_net(), input_shape=(1, 6, 6))
    assert walk_size(cm.graph) == MAX_WALK
    data = np.random.default_rng(1).normal(size=(9, 1, 6, 6))
    loader = torch.utils.data.DataLoader(torch.tensor(data), batch_size=9)
    whole, parts = pathir.observe(cm, data), pathir.observe(cm, loader, batch_size=2)
    for k, v in whole.columns.items():
        np.testing.assert_allclose(parts.columns[k], v, rtol=1e-12)
