"""pathir leaves the process as it found it: torch's flush-denormal setting, and no thread left running."""

import subprocess
import sys
import threading

import numpy as np
import torch

import pathir


def test_flush_denormal_is_read_right_when_pathir_was_imported_under_it():
    """The setting was read off the literal 1e-310, which Python reads as 0 while subnormals are flushed and
    keeps in the module's constants: imported under flushing, every walk then left flushing on."""
    code = (
        "import torch\n"
        "torch.set_flush_denormal(True)\n"
        "import pathir\n"
        "from pathir.backends.torch import flushing_denormals\n"
        "torch.set_flush_denormal(False)\n"
        "assert not flushing_denormals()\n"
        "net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "pathir.compile(net, input_shape=(3,)).path_norm(2)\n"
        "one = torch.ones(1, dtype=torch.int64).view(torch.float64)\n"
        "assert (one * 1.0).item() > 0, 'pathir left flushing on'\n"
    )
    run = subprocess.run([sys.executable, "-B", "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_no_thread_is_left_running():
    """tqdm starts a monitor thread for every bar, a disabled one too."""
    before = {t.name for t in threading.enumerate()}
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    cm = pathir.compile(net, input_shape=(3,), progress=False)
    cm.pathcond(progress=False)
    pathir.observe(cm, np.zeros((3, 3)), progress=False)
    assert {t.name for t in threading.enumerate()} <= before
