"""In-place ops and aliasing: the IR reads what eager PyTorch reads, or the model is refused."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from capture_reference import assert_forward, path_norm_q

import pathir
from pathir.errors import UnsupportedOperation


class _Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)


class AugmentedAlias(_Lin):
    """g = h; h += f(x): g is h, so it reads the sum."""

    def forward(self, x):
        h = self.a(x)
        g = h
        h += self.b(x)
        return self.c(F.relu(g))


class ReluUnderscoreSkip(_Lin):
    """relu_ on h, then h read by a skip path: the skip reads relu(h)."""

    def forward(self, x):
        h = self.a(x)
        y = torch.relu_(h)
        return self.c(h + y)


class ModuleInplaceSkip(_Lin):
    def __init__(self):
        super().__init__()
        self.r = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.a(x)
        y = self.r(h)
        return self.c(h) + self.c(y)


class FunctionalInplace(_Lin):
    def forward(self, x):
        h = self.a(x)
        F.relu(h, inplace=True)  # result unused: h itself is mutated
        h.relu_()
        return self.c(h)


class MethodAddInplace(_Lin):
    def forward(self, x):
        h = self.a(x)
        k = h.detach()  # shares h's storage
        h.add_(self.b(x))
        return self.c(F.relu(k))


class ReadBeforeIsFine(_Lin):
    """The skip reads h before the in-place ReLU: eager reads the old value."""

    def forward(self, x):
        h = self.a(x)
        skip = self.c(h)
        h.relu_()
        return skip + self.c(h)


class SliceReluInplace(_Lin):
    def forward(self, x):
        h = self.a(x)
        h[:, :2].relu_()
        return self.c(h)


class SliceAugmented(_Lin):
    def forward(self, x):
        h = self.a(x)
        h[:, :2] += h[:, 2:]
        return self.c(F.relu(h))


class ViewThenMutateBase(_Lin):
    def forward(self, x):
        h = self.a(x)
        v = h.view(-1, 2, 2)
        h.relu_()
        return self.c(v.flatten(1))


class MutateInput(_Lin):
    def forward(self, x):
        x.relu_()
        return self.c(self.a(x) + self.b(x))


@pytest.mark.parametrize("cls", [AugmentedAlias, ReluUnderscoreSkip, ModuleInplaceSkip, FunctionalInplace,
                                 MethodAddInplace, ReadBeforeIsFine])
def test_inplace_rebinds_like_eager(cls):
    torch.manual_seed(0)
    model = cls().double()
    cm = assert_forward(model, (3,))
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(3,)], q), rel=1e-10)


def test_inplace_on_the_input():
    torch.manual_seed(0)
    model = MutateInput().double()
    cm = pathir.compile(model, input_shape=(3,))
    x = torch.randn(4, 3, dtype=torch.float64)
    out = cm.forward(x.numpy().copy(), backend="numpy")
    assert abs(out - model(x.clone()).detach().numpy()).max() < 1e-12


@pytest.mark.parametrize("cls", [SliceReluInplace, SliceAugmented, ViewThenMutateBase])
def test_inplace_through_a_view_has_eager_semantics(cls):
    """Lowered from torch.export's functionalized graph (tests/test_functional_writes.py)."""
    torch.manual_seed(0)
    model = cls().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cm = assert_forward(model, (3,), tol=1e-12)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(3,)], q), rel=1e-10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class MutateParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x):
        self.a.weight.data.mul_(1.0)  # hostile: changes the model while it runs
        return self.a(x)


def test_inplace_on_a_parameter_is_refused():
    with pytest.raises(UnsupportedOperation):
        pathir.compile(MutateParam(), input_shape=(3,))


def test_torchvision_resnet_inplace_relus_still_compile():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=5).double()
    assert_forward(model, (3, 32, 32), tol=1e-9, batch=2)


class CastThenMutate(_Lin):
    """In a float64 model x.double() is x itself (torch returns self for its own dtype): a write through it writes
    x, as the eager forward does; a cast to another dtype is refused before any write."""

    def forward(self, x):
        h = self.a(x)
        y = h.double()
        y.relu_()
        return self.c(h + y)


class ChunkThenMutate(_Lin):
    def forward(self, x):
        h = self.a(x)
        p, q = h.chunk(2, dim=1)
        p.relu_()
        return self.c(h)


class SetItemZero(_Lin):
    def forward(self, x):
        h = self.a(x)
        h[:, 0] = 0.0
        return self.c(h)


@pytest.mark.parametrize("cls,match", [(ChunkThenMutate, "in-place op on .* writes storage .* torch.export, whose "
                                                         "functionalized graph .* failed")])
def test_writes_torch_export_cannot_functionalize_are_refused(cls, match):
    model = cls().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedOperation, match=match):
        pathir.compile(model, input_shape=(3,))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("cls", [SetItemZero, CastThenMutate])
def test_more_writes_through_aliases_have_eager_semantics(cls):
    """Lowered from torch.export's functionalized graph (tests/test_functional_writes.py)."""
    torch.manual_seed(0)
    model = cls().double()
    cm = assert_forward(model, (3,), tol=1e-12)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(3,)], q), rel=1e-10)


class InplaceOnConcat(_Lin):
    """relu_ on a tensor that a later torch.cat reads: the cat sees the ReLU."""

    def forward(self, x):
        h = self.a(x)
        g = self.b(x)
        torch.relu_(h)
        return self.c(torch.relu(torch.cat([h, g], dim=1)[:, :4] + h))


def test_inplace_then_cat_rebinds():
    torch.manual_seed(0)
    model = InplaceOnConcat().double()
    cm = assert_forward(model, (3,))
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(3,)], q), rel=1e-10)


class ExportInplaceSkip(_Lin):
    """Control flow on a shape sends it to torch.export: the ATen graph keeps relu_ and add_."""

    def forward(self, x):
        h = self.a(x)
        g = h
        if h.shape[1] == 4:
            h += self.b(x)
        y = torch.relu_(h)
        return self.c(g + y)


def test_export_fallback_rebinds_like_eager():
    torch.manual_seed(0)
    model = ExportInplaceSkip().double()
    cm = assert_forward(model, (3,))
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(3,)], q), rel=1e-10)


@pytest.mark.parametrize("cls", [ReluUnderscoreSkip, AugmentedAlias, ExportInplaceSkip])
def test_pathcond_keeps_the_function_of_aliasing_models(cls):
    torch.manual_seed(0)
    model = cls().double()
    x = torch.randn(6, 3, dtype=torch.float64)
    before = model(x.clone()).detach()
    pathir.compile(model, input_shape=(3,)).pathcond()
    assert torch.allclose(model(x.clone()).detach(), before, rtol=1e-10, atol=1e-12)


class SizeArithmetic(_Lin):
    """n += 1 on a size is Python arithmetic: nothing is written."""

    def forward(self, x):
        h = torch.relu(self.a(x))
        n = h.size(0)
        m = n
        m += 0
        return self.c(h.view(n, -1)) + self.c(h.reshape(m, 4))


def test_augmented_assignment_on_a_size_is_not_a_write():
    torch.manual_seed(0)
    assert_forward(SizeArithmetic().double(), (3,))


def test_a_copy_from_an_overlapping_view_of_the_written_memory_is_refused():
    """``h[:, 1:].copy_(h[:, :-1])``: eager's result depends on its copy order (it smears h[:, 0]), which no
    traced or functionalized graph reproduces."""
    import pathir
    from pathir.frontends.torch.capture_checks import ReadsWhatItWrites

    class Shift(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

        def forward(self, x):
            h = self.a(x)
            h[:, 1:].copy_(h[:, :-1])
            return self.b(torch.relu(h))

    with pytest.raises(ReadsWhatItWrites, match="view of the memory"):
        pathir.compile(Shift(), input_shape=(4,))


class _Writes(torch.nn.Module):
    """``write`` on the first layer's output; ``untraceable``: Python control flow on shapes first (fx fails:
    torch.export reads the model)."""

    def __init__(self, write, untraceable=True):
        super().__init__()
        self.write, self.untraceable = write, untraceable
        self.a, self.b = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        if self.untraceable and x.dim() < 2:
            return x
        h = self.a(x)
        self.write(h)
        return self.b(torch.relu(h))


def _add_shifted(h):
    h[:, :-1] += h[:, 1:]


def _copy_shifted(h):
    h[:, 1:] = h[:, :-1]


def _add_disjoint(h):
    h[:, :2] += h[:, 2:4]


def _add_itself(h):
    h += h


@pytest.mark.parametrize("write", [_add_shifted, _copy_shifted])
def test_an_overlapping_in_place_write_is_refused_on_the_torch_export_path_too(write):
    """torch.export's functional graph reads the old values, where eager reads what its copy order has written
    (and torch refuses the add at a batch of one): the export path accepted ``h[:, :-1] += h[:, 1:]``, which fx
    refuses. Run once eagerly, the write is refused by its ATen op."""
    import pathir
    from pathir.frontends.torch.capture_checks import ReadsWhatItWrites

    torch.manual_seed(0)
    model = _Writes(write).double()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ReadsWhatItWrites, match=r"\(op aten\.(add_|copy_).*view of the memory it writes"):
        pathir.compile(model, input_shape=(4,))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("write", [_add_disjoint, _add_itself])
def test_in_place_writes_from_disjoint_or_identical_views_compile_on_the_torch_export_path(write):
    """Another view of the same memory that shares no element, or the very same view (each element read where it
    is written): eager's result is the functional graph's."""
    torch.manual_seed(0)
    assert_forward(_Writes(write).double(), (4,))


def _add_view_of_a_view(h):
    g = h[:, :1]
    g += h[:, 1:2]


@pytest.mark.parametrize("write", [_add_disjoint, _add_view_of_a_view])
def test_a_write_from_a_disjoint_view_fx_cannot_tell_apart_compiles_through_torch_export(write):
    """fx refused ``g = h[:, :1]; g += h[:, 1:2]`` as reading what it writes (another view of the same base, which
    elements it cannot tell); the model now goes to torch.export, whose eager run finds no element shared."""
    torch.manual_seed(0)
    assert_forward(_Writes(write, untraceable=False).double(), (4,))


@pytest.mark.parametrize("write", [_add_shifted, _copy_shifted])
def test_an_overlapping_write_fx_traces_is_still_refused(write):
    from pathir.frontends.torch.capture_checks import ReadsWhatItWrites

    with pytest.raises(ReadsWhatItWrites, match="view of the memory it writes"):
        import pathir

        pathir.compile(_Writes(write, untraceable=False).double(), input_shape=(4,))


def test_an_overlapping_write_torch_itself_refuses_is_explained_as_such():
    """``v[1:] += v[:-1]`` on a flat view: torch raises at any batch ('refer to a single memory location'); pathir
    passed its error on with the hint that the input shape was wrong."""
    import pathir

    def shifted_flat(h):
        v = h.view(-1)
        v[1:] += v[:-1]

    with pytest.raises(pathir.PathirError, match="reads a view of the memory it writes .*torch refuses"):
        pathir.compile(_Writes(shifted_flat, untraceable=False).double(), input_shape=(4,))


def _copy_flipped(h):
    h.copy_(h.flip(-1).clone())


def _copy_first_broadcast(h):
    h.copy_(h[:, :1].clone())


def _copy_rolled_into_a_slice(h):
    h[:, :3].copy_(h[:, 3:].roll(1, -1))


@pytest.mark.parametrize("untraceable", [False, True])
@pytest.mark.parametrize("write", [_copy_flipped, _copy_first_broadcast, _copy_rolled_into_a_slice])
def test_a_copy_into_an_activation_is_its_source_on_both_paths(write, untraceable):
    """``h.copy_(src)``: later readers of h read src (broadcast sample by sample); fx refused copy_ as 'outside the
    ReLU DAG model' where torch.export's functional graph lowered it."""
    torch.manual_seed(0)
    model = _Writes(write, untraceable).double()
    cm = assert_forward(model, (4,), tol=1e-12)
    for q in (1.0, 2.0):
        assert cm.path_norm(q) ** q == pytest.approx(path_norm_q(model, [(4,)], q), rel=1e-10)


def test_a_copy_that_broadcasts_across_the_batch_is_refused():
    """A source of fewer axes per sample would broadcast its batch axis along one of h's own (batch-dependent)."""
    class Lower(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 12), nn.Linear(12, 2)

        def forward(self, x):
            h = torch.relu(self.a(x)).view(-1, 2, 6)
            h.copy_(h[:, 0].clone())
            return self.b(h.flatten(1))

    with pytest.raises(UnsupportedOperation, match="only a value of the same rank broadcasts"):
        pathir.compile(Lower().double(), input_shape=(3,), self_check=False)
