"""pathir.integrations.pruning_adapter.PathMagnitudeImportance against Torch-Pruning (skipped when it is not installed).

The group scores are recomputed here from ``cm.path_magnitude_scores()`` by hand, layer by layer (rows
of the convs writing a channel, columns of those reading it, the folded batch-norm biases), and the
channels a MetaPruner removes must be the lowest-scoring ones; the pruned model still runs."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tp = pytest.importorskip("torch_pruning")
nn = torch.nn

import pathir  # noqa: E402
from pathir.errors import PathirError  # noqa: E402
from pathir.integrations.pruning_adapter import PathMagnitudeImportance  # noqa: E402


class SmallResNet(nn.Module):
    """stem conv-bn-relu, one basic block (conv-bn-relu-conv-bn + skip), relu, global pool, linear."""

    def __init__(self, c=8, hidden=6, classes=3):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv1, self.bn1 = nn.Conv2d(c, hidden, 3, padding=1, bias=False), nn.BatchNorm2d(hidden)
        self.conv2, self.bn2 = nn.Conv2d(hidden, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        h = torch.relu(self.bn0(self.stem(x)))
        r = torch.relu(self.bn1(self.conv1(h)))
        h = torch.relu(self.bn2(self.conv2(r)) + h)
        return self.fc(nn.functional.adaptive_avg_pool2d(h, 1).flatten(1))


def _model(seed=0):
    torch.manual_seed(seed)
    model = SmallResNet()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.2, 2.0)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _expected_group_scores(model):
    """By hand: the channels of conv1 (its own group) and of the residual stream (stem, conv2, skip, fc)."""
    s = pathir.compile(model, input_shape=(3, 8, 8)).path_magnitude_scores()
    rows = lambda name: s[name].reshape(s[name].shape[0], -1).sum(1)  # noqa: E731
    cols = lambda name: s[name].swapaxes(0, 1).reshape(s[name].shape[1], -1).sum(1)  # noqa: E731
    hidden = rows("conv1.weight") + s["bn1.bias"] + cols("conv2.weight")
    stream = rows("stem.weight") + s["bn0.bias"] + rows("conv2.weight") + s["bn2.bias"] + cols("conv1.weight") \
        + cols("fc.weight")
    return hidden, stream


def _kept(old_stats, new_stats):
    """Which channels a pruned batch-norm kept (its running means are distinct random values, matched exactly)."""
    return sorted(int(torch.nonzero(old_stats == v)[0]) for v in new_stats)


def test_group_scores_are_the_summed_path_magnitudes_of_what_each_channel_removal_deletes():
    model = _model()
    hidden, stream = _expected_group_scores(model)
    graph = tp.DependencyGraph().build_dependency(model, example_inputs=torch.randn(1, 3, 8, 8))
    imp = PathMagnitudeImportance(model, input_shape=(3, 8, 8))
    got1 = imp(graph.get_pruning_group(model.conv1, tp.prune_conv_out_channels, list(range(6)))).numpy()
    got2 = imp(graph.get_pruning_group(model.stem, tp.prune_conv_out_channels, list(range(8)))).numpy()
    np.testing.assert_allclose(got1, hidden, rtol=1e-12)
    np.testing.assert_allclose(got2, stream, rtol=1e-12)
    assert len(set(np.round(hidden, 12))) == 6  # distinct scores: the ranking below is well defined


def test_meta_pruner_removes_the_lowest_path_magnitude_channels_and_the_model_runs():
    model = _model(seed=1)
    hidden, stream = _expected_group_scores(model)
    old_bn1, old_bn0 = model.bn1.running_mean.clone(), model.bn0.running_mean.clone()
    x = torch.randn(2, 3, 8, 8)
    pruner = tp.pruner.MetaPruner(model, x, importance=PathMagnitudeImportance(model, input_shape=(3, 8, 8)),
                                  pruning_ratio=0.5, ignored_layers=[model.fc])
    pruner.step()
    assert model.conv1.out_channels == 3 and model.stem.out_channels == 4
    assert _kept(old_bn1, model.bn1.running_mean) == sorted(np.argsort(hidden)[3:].tolist())
    assert _kept(old_bn0, model.bn0.running_mean) == sorted(np.argsort(stream)[4:].tolist())
    out = model(x)
    assert out.shape == (2, 3) and torch.isfinite(out).all()
    pathir.compile(model, input_shape=(3, 8, 8)).path_magnitude_scores()  # still a ReLU network pathir reads


def test_scores_follow_the_model_and_are_rescaling_invariant():
    model = _model(seed=2)
    graph = tp.DependencyGraph().build_dependency(model, example_inputs=torch.randn(1, 3, 8, 8))
    imp = PathMagnitudeImportance(model, input_shape=(3, 8, 8))
    group = graph.get_pruning_group(model.conv1, tp.prune_conv_out_channels, list(range(6)))
    before = imp(group)
    pathir.compile(model, input_shape=(3, 8, 8)).pathcond()  # another representative of the same function
    after = imp(group)
    assert torch.allclose(after, before, rtol=1e-5) and not torch.equal(after, before)  # float32 model
    with torch.no_grad():
        model.conv1.weight[0].mul_(10.0)  # an edit the scores must see
    assert imp(group)[0] > 5 * before[0]


def test_grouped_convolutions_are_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).eval()
    graph = tp.DependencyGraph().build_dependency(model, example_inputs=torch.randn(1, 4, 6, 6))
    imp = PathMagnitudeImportance(model, input_shape=(4, 6, 6))
    with pytest.raises(PathirError, match="grouped conv '0'"):
        imp(graph.get_pruning_group(model[0], tp.prune_conv_out_channels, list(range(4))))
