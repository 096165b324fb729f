"""README.md's Python example runs as written, and what its comments say it returns is what it returns."""

import ast
import re
from pathlib import Path

import numpy as np
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_a_python_example():
    assert len(python_blocks(README.read_text())) >= 1


def test_readme_python_example_runs_and_its_comments_hold():
    namespace: dict = {}
    x = torch.randn(2, 3, 224, 224)
    before = None
    for block in python_blocks(README.read_text()):
        for statement in ast.parse(block).body:
            if "pathcond(" in ast.unparse(statement):  # "rescales `model` in place (function preserved)"
                with torch.no_grad():
                    before = namespace["model"](x)
                    params_before = {k: v.clone() for k, v in namespace["model"].named_parameters()}
            exec(compile(ast.Module([statement], []), str(README), "exec"), namespace)
    cm, model, g, report = namespace["cm"], namespace["model"], namespace["g"], namespace["report"]
    # g = cm.diag_g(): {source parameter name: numpy array of that parameter's shape}
    params = dict(model.named_parameters())
    assert g and all(isinstance(v, np.ndarray) for v in g.values())
    assert all(g[name].shape == tuple(params[name].shape) for name in g)
    # cm.path_norm(q=2), cm.num_paths(log10=True): plain floats
    assert isinstance(cm.path_norm(q=2), float) and isinstance(cm.num_paths(log10=True), float)
    # report = cm.pathcond(): the model was rescaled in place, its function kept
    assert before is not None and report.objective_after < report.objective_before
    with torch.no_grad():
        after = model(x)
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-4)
    assert any(not torch.equal(params_before[k], v) for k, v in model.named_parameters())
