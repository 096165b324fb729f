"""Every torchvision model the torch frontend compiles, exported with both torch
exporters, compiles from ONNX with the same path-norms, path count and diag G
(on the same weights: exports that keep every parameter as it is) and the same
forward as onnxruntime (exports that fold batch-norms in float32)."""

import numpy as np
import pytest
import torch
from onnx_cases import export, ort_run, rel

import pathir
from pathir.app import zoo

FAST = {"resnet18", "squeezenet1_1"}


def _shape(name: str):
    """Small inputs where the model allows them (adaptive pools export cleanly at 224 only for alexnet/vgg)."""
    if name == "inception_v3":
        return (3, 299, 299)
    if name == "alexnet" or name.startswith("vgg"):
        return (3, 224, 224)
    return (3, 64, 64)


def _model(name: str):
    model = zoo.build(name)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-trivial batch-norm affine as well (zoo.build draws the statistics)
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()


def _params(names):
    return [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow]) for n in names]


@pytest.mark.parametrize("name", _params(zoo.SUPPORTED))
def test_zoo_model_from_onnx_has_the_torch_frontends_path_quantities(name):
    model, shape = _model(name), _shape(name)
    ct = pathir.compile(model, input_shape=shape)
    norms = {q: ct.path_norm(q, log10=True) for q in (1, 2)}
    paths = ct.num_paths(log10=True)
    g_torch = ct.diag_g()
    thresholds_torch = _thresholds(ct)
    # parameters the eval forward depends on, by autograd (an export leaves out googlenet's
    # auxiliary classifiers; a conv bias folded into its batch-norm is used, though no IR param names it)
    out = model(torch.randn(1, *shape))
    grads = torch.autograd.grad(out.sum(), list(model.parameters()), allow_unused=True)
    n_used = sum(p.numel() for p, g in zip(model.parameters(), grads) if g is not None)
    n_params = ct.graph.num_params()
    del out, grads, ct  # one model-size copy at a time on vgg (the test peaked near 11 GB on vgg19)
    for exporter in ("legacy-nofold", "dynamo-noopt"):
        cm = g = None  # the previous exporter's Compiled and diag G go before the next is built
        cm = pathir.compile(export(model, shape, exporter, batch=1))
        assert cm.source_num_params == n_used, exporter
        assert cm.graph.num_params() == n_params, exporter
        # 3e-9 relative on the norm (log10 agrees to 3e-9 / ln(10)), 1e-8 on diag G (a product of many such
        # factors): the file stores each batch-norm's eps as
        # float32, which onnxruntime adds as it is (0.0010000000475 for inception_v3's 1e-3), torch as the
        # module's float64 eps: the two models differ by that much (inception_v3: 1.3e-9)
        for q in (1, 2):
            assert abs(cm.path_norm(q, log10=True) - norms[q]) <= 1.3e-9, (exporter, q)
        assert abs(cm.num_paths(log10=True) - paths) <= 5e-12, exporter
        g = cm.diag_g()
        # a clipped ReLU's threshold is named by its module in torch and by its Clip node in ONNX: matched in
        # graph order; every other param by name
        pairs = [(k, k) for k in g_torch if k not in thresholds_torch]
        assert len(_thresholds(cm)) == len(thresholds_torch), exporter
        pairs += list(zip(thresholds_torch, _thresholds(cm)))
        assert set(g) == {k for _, k in pairs}, exporter
        for k_torch, k in pairs:
            v = g_torch[k_torch]
            np.testing.assert_allclose(g[k], v, rtol=1e-8, atol=1e-300 + 1e-12 * np.abs(v).max(),  # (eps: above)
                                       err_msg=f"{exporter}: {k}")


def _thresholds(cm) -> list[str]:
    """The source names of the graph's clipped-ReLU threshold params, in graph order."""
    from pathir.ir import Role

    return [p.source_name for p in cm.graph.params() if any(r.role is Role.CLIP_THRESHOLD for r in p.sources)]


@pytest.mark.parametrize("name", _params(zoo.SUPPORTED))
def test_zoo_model_from_optimised_onnx_matches_onnxruntime(name):
    model, shape = _model(name), _shape(name)
    ct = pathir.compile(model, input_shape=shape)
    x = np.random.default_rng(0).normal(size=(2, *shape)).astype(np.float32)
    for exporter in ("legacy", "dynamo"):
        proto = export(model, shape, exporter, batch=1)
        cm = pathir.compile(proto)
        out = cm.forward(x.astype(np.float64))
        out = out.cpu().numpy() if isinstance(out, torch.Tensor) else out
        assert rel(out, ort_run(proto, x)[0]) <= 1e-5, exporter
        # batch-norms folded by the exporter in float32: the same network up to rounding
        assert abs(cm.path_norm(1, log10=True) - ct.path_norm(1, log10=True)) <= 1e-5, exporter
