"""timm's ReLU families compile and match the definition; the others are refused, untouched.

For each model (random init, float64, eval mode, small input):

- pathir's forward equals the model's own;
- the l1 path-norm equals the definition computed without pathir: a deep copy with every
  parameter |θ| (a batch-norm as the per-channel affine |γ/σ| x + |β - μγ/σ|), ReLU -> identity,
  ReLU6 -> 2x + 6^q (its ReLU DAG A − ReLU(A − 6): two paths through x, |±1|^q, and the bias path
  of −6), max-pool -> window sum, fed all ones (the fixed coefficients of these models, average pools,
  blur filters, nearest/bilinear upsampling, padding, are non-negative: |c| = c); for q = 2 each
  parameter-free pooling or upsampling layer is replaced by its own matrix, per channel, with
  every coefficient squared (not for blur pools: their reflect padding is a layer of neurons of
  its own, so their q = 2 definition needs the pad and the filter apart);
- PathCond keeps the function of the smaller ones.

Families with non-homogeneous parts are refused naming the op, the model untouched.
"""

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pathir
from pathir.errors import UnsupportedOperation

timm = pytest.importorskip("timm")

SHAPE = (3, 64, 64)
SHAPES = {"inception_resnet_v2": (3, 96, 96)}  # its stem needs more than 64x64
FAST = ["resnet10t", "resnetblur18", "resnet26d", "hrnet_w18_small"]
SLOW = ["resnet18", "resnetaa50", "densenet121", "densenetblur121d", "dla34", "vgg11", "selecsls42",
        "mobileone_s0", "regnetx_002", "dpn68", "xception41", "spnasnet_100", "fbnetc_100", "res2net50_14w_8s",
        "resnetv2_50", "repvgg_a0", "gernet_s", "inception_resnet_v2", "mobilenetv2_050"]
REFUSED = {
    "mnasnet_small": "Sigmoid",
    "regnety_002": "sigmoid",
    "efficientnet_b0": "SiLU",
    "ese_vovnet19b_slim_dw": "Hardsigmoid",
    "convnext_atto": "layer_norm",
    "cspresnet50": "LeakyReLU",
    "nf_resnet26": "batch_norm",  # weight standardization: batch_norm(training=True) on a parameter
}


def _model(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model.double().eval()


class _Sum(nn.Module):
    """A max-pool's window sum (padding positions are no neurons: they add 0)."""

    def __init__(self, pool: nn.MaxPool2d):
        super().__init__()
        assert pool.dilation in (1, (1, 1))
        self.args = dict(kernel_size=pool.kernel_size, stride=pool.stride, padding=pool.padding,
                         ceil_mode=pool.ceil_mode, count_include_pad=True, divisor_override=1)

    def forward(self, x):
        return F.avg_pool2d(x, **self.args)


class _ClipNorm(nn.Module):
    """A clipped ReLU min(max(x, 0), t) in the path-norm network: A + B with B = A + |−t|^q (fixed
    weights |1|^q, |−1|^q = 1)."""

    def __init__(self, t: float, q: float):
        super().__init__()
        self.c = abs(t) ** q

    def forward(self, x):
        return 2 * x + self.c


class _PerChannelPower(nn.Module):
    """A parameter-free per-channel layer as its own matrix (read on one-hot inputs in
    channel 0), every coefficient c -> |c|^q."""

    def __init__(self, op, q):
        super().__init__()
        self.op, self.q, self.M = op, q, None

    def forward(self, x):
        B, C, *spatial = x.shape
        n = math.prod(spatial)
        if self.M is None:
            basis = torch.zeros(n, C, *spatial, dtype=x.dtype)
            basis[:, 0].reshape(n, n).copy_(torch.eye(n, dtype=x.dtype))
            out = self.op(basis)[:, 0]
            self.out_spatial = out.shape[1:]
            self.M = out.reshape(n, -1).abs() ** self.q
        y = x.reshape(B * C, n) @ self.M
        return y.reshape(B, C, *self.out_spatial)


#: parameter-free per-channel layers with fixed coefficients, replaced for q != 1
_FIXED = {"AvgPool2d", "AdaptiveAvgPool2d", "FastAdaptiveAvgPool", "Upsample"}


def definition_path_norm(model, q, shape=SHAPE):
    """sum_p |Φ_p|^q without pathir (see the module docstring)."""
    ref = copy.deepcopy(model)
    done = set()  # batch-norm affines, set to their folded |.|^q
    with torch.no_grad():
        for name, m in list(ref.named_modules()):
            for child_name, child in list(m.named_children()):
                new = None
                if isinstance(child, nn.ReLU):
                    new = nn.Identity()
                elif isinstance(child, nn.ReLU6):
                    new = _ClipNorm(6.0, q)
                elif isinstance(child, nn.MaxPool2d):
                    new = _Sum(child)
                elif isinstance(child, nn.modules.batchnorm._BatchNorm):
                    scale = child.weight / torch.sqrt(child.running_var + child.eps)
                    child.bias.copy_((child.bias - child.running_mean * scale).abs() ** q)
                    child.weight.copy_(scale.abs() ** q)
                    child.running_mean.zero_()
                    child.running_var.fill_(1 - child.eps)
                    done.update({id(child.weight), id(child.bias)})
                elif q != 1 and type(child).__name__ in _FIXED:
                    new = _PerChannelPower(child, q)
                if new is not None:
                    setattr(m, child_name, new)
        for p in ref.parameters():
            if id(p) not in done:
                p.copy_(p.abs() ** q)
        return float(ref(torch.ones(1, *shape, dtype=torch.float64)).sum())


def _check(name, q2=True, pathcond=False):
    model, shape = _model(name), SHAPES.get(name, SHAPE)
    cm = pathir.compile(model, input_shape=shape)
    x = torch.randn(2, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
    got = torch.as_tensor(cm.forward(x))
    assert float((got - before).abs().max() / before.abs().max()) <= 1e-10
    assert math.isclose(cm.path_norm(1), definition_path_norm(model, 1, shape), rel_tol=1e-9)
    if q2:
        assert math.isclose(cm.path_norm(2) ** 2, definition_path_norm(model, 2, shape), rel_tol=1e-9)
    if pathcond:
        cm.pathcond()
        with torch.no_grad():
            assert float((model(x) - before).abs().max() / before.abs().max()) <= 1e-10


@pytest.mark.parametrize("name", FAST)
def test_small_timm_relu_models_match_the_definition(name):
    _check(name, q2="blur" not in name, pathcond=name != "hrnet_w18_small")


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_timm_relu_families_match_the_definition(name):
    # vgg11's head calls F.adaptive_avg_pool2d itself (inputs below 7x7), inception-resnet scales its
    # residual branches by a constant (x * 0.17): fixed coefficients outside modules, q = 1 only
    q2 = "blur" not in name and name not in ("vgg11", "inception_resnet_v2")
    _check(name, q2=q2, pathcond=name in ("resnet18", "dla34", "regnetx_002", "mobilenetv2_050"))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_non_homogeneous_timm_families_are_refused_naming_the_op_untouched(name):
    model = _model(name)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(UnsupportedOperation) as err:
        pathir.compile(model, input_shape=SHAPE)
    assert REFUSED[name] in str(err.value)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
