"""The public names moved by the re-layout still import, each old module path with a DeprecationWarning."""

import importlib
import sys

import pytest


@pytest.mark.parametrize("old,new,name", [("pathir.passes.find_units", "pathir.analyses.find_units", "find_units"),
                                          ("pathir.passes.incidence", "pathir.analyses.incidence", "incidence")])
def test_moved_analyses_import_from_their_old_paths_with_a_warning(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_public_names_kept():
    import pathir
    from pathir.checks import check
    from pathir.optim import PathSGD
    from pathir.passes import normalize

    assert check is importlib.import_module("pathir.app.checks").check
    assert PathSGD is importlib.import_module("pathir.integrations.optim").PathSGD
    assert pathir.passes.PASSES["normalize"] is normalize
