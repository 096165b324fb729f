"""Peak memory of every public method, in units of the float64 size of the model's parameters.

    python benchmarks/bench_memory.py [vgg16,vgg11_bn,resnet50] [--methods path_norm,diag_g,...]
                                      [--limit-gb 12] [--json out.json]

Each (model, method) runs in a FRESH subprocess (so no call inherits another's
heap), under an address-space limit (``--limit-gb``, RLIMIT_AS) so that a
runaway call fails instead of exhausting a shared machine. In the child:

1. build the zoo model (float32, eval), ``pathir.compile`` it with the default
   self-check and backend, and let the memory settle (gc, malloc_trim);
2. ``base`` = resident memory now; the peak counter (VmHWM) is reset through
   /proc/self/clear_refs (else a sampling thread reads VmRSS every 2 ms);
3. run the method once; ``peak`` = VmHWM − base: what the call needs;
4. ``kept`` = VmRSS − base after the call (settled): the caches that outlive it
   (units, B, row keys, the backend's device copies; a write-back method's
   rescaled graph replaces the old one, so it keeps ~0);
5. ``cm.release()``; ``after_release`` = VmRSS − base: what release could not free.

Figures are in "copies": bytes / (8 × the model's parameter count); the goal is
peak ≤ 4 copies on vgg16 and vgg11_bn. The baseline row ``forward_backward`` is the model's own
float64 forward+backward at batch 1 (autograd: its activations and gradients; the float64 copy of
the model is made before ``base``, as pathir's compile is): what one training-style pass of the
model needs. A walk that keeps a value per feature-map entry (diag G, PathCond) needs about that
on a model whose feature maps outweigh its parameters (densenet, shufflenet). ``path_metric`` compares the model with a
pruned copy of itself (a second Compiled, compiled before ``base``). ``penalty`` is
``cm.path_norm(2, differentiable=True).backward()``, the float32 ``.grad`` it creates included.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
import threading
import time

from rows_out import measured, save_json  # run as a script: benchmarks/ is on sys.path

METHODS = ("path_norm", "diag_g", "path_magnitude_scores", "path_metric", "prune", "normalize", "pathcond",
           "enorm", "equalize", "penalty")
MODELS = ("vgg16", "vgg11_bn", "resnet50")
#: the model's own float64 forward+backward at batch 1: the baseline row
BASELINE = "forward_backward"


def _status(field: str) -> int:
    """A VmXXX field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def settle() -> int:
    """Collect garbage and give freed heap back to the OS; the resident size after."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return _status("VmRSS")


class PeakMeter:
    """Peak resident memory from now on: VmHWM after a reset through clear_refs when
    the kernel allows it, else a thread sampling VmRSS every 2 ms (may miss short spikes)."""

    def __init__(self):
        self.sampled = 0
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.thread = None
        except OSError:
            self.stop = threading.Event()
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

    def _sample(self):
        while not self.stop.is_set():
            self.sampled = max(self.sampled, _status("VmRSS"))
            time.sleep(0.002)

    def peak(self) -> int:
        if self.thread is None:
            return _status("VmHWM")
        self.stop.set()
        self.thread.join()
        return max(self.sampled, _status("VmRSS"))


def _call(cm, method: str, other):
    import pathir

    if method == BASELINE:
        model, x = other
        model(x).sum().backward()
        return None
    if method == "path_norm":
        return cm.path_norm()
    if method == "path_metric":
        return pathir.path_metric(cm, other)
    if method == "prune":
        return cm.prune(0.5)
    if method == "equalize":
        return cm.equalize(progress=False)
    if method == "penalty":  # the differentiable path-norm's forward and backward (the model's .grad included)
        cm.path_norm(2.0, differentiable=True).backward()
        return None
    return getattr(cm, method)()


def child(model_name: str, method: str) -> dict:
    import torch

    import pathir
    from pathir.app import zoo

    model = zoo.build(model_name).eval()
    n_params = sum(p.numel() for p in model.parameters())
    unit = 8 * n_params
    start = time.perf_counter()
    cm = pathir.compile(model, input_shape=zoo.input_shape(model_name))
    compile_s = time.perf_counter() - start
    other = None
    if method == "path_metric":
        twin = zoo.build(model_name).eval()
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_((torch.rand_like(p) > 0.1).to(p.dtype))
        other = pathir.compile(twin, input_shape=zoo.input_shape(model_name), self_check=False)
        del twin
    if method == BASELINE:
        other = (model.double(), torch.ones(1, *zoo.input_shape(model_name), dtype=torch.float64))
    base = settle()
    meter = PeakMeter()
    start = time.perf_counter()
    result = _call(cm, method, other)
    call_s = time.perf_counter() - start
    peak = meter.peak() - base
    del result
    kept = settle() - base
    built = cm.facts.built()
    cm.release()
    released = settle() - base
    return {"model": model_name, "method": method, "params": n_params, "param_gb_f64": unit / 1e9,
            "compile_s": compile_s, "call_s": call_s, "base_gb": base / 1e9,
            "peak_gb": peak / 1e9, "kept_gb": kept / 1e9, "after_release_gb": released / 1e9,
            "peak_copies": peak / unit, "kept_copies": kept / unit, "after_release_copies": released / unit,
            "kept_facts": list(built), "peak_meter": "VmHWM" if meter.thread is None else "sampled"}


def run_one(model_name: str, method: str, limit_gb: float) -> dict:
    """One (model, method) in a fresh subprocess under an address-space limit."""
    def limit():
        cap = int(limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    proc = subprocess.run([sys.executable, __file__, "--child", model_name, method], capture_output=True,
                          text=True, preexec_fn=limit, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"model": model_name, "method": method, "error": f"exit {proc.returncode}: {tail[0][:200]}"}
    return json.loads(lines[-1])


def table(rows) -> str:
    out = ["| model | method | peak (copies) | peak GB | kept after the call (copies) | after release | time s |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | `{r['method']}` | failed: {r['error']} | | | | |")
            continue
        out.append(f"| {r['model']} | `{r['method']}` | {r['peak_copies']:.2f} | {r['peak_gb']:.2f} | "
                   f"{r['kept_copies']:.2f} | {r['after_release_copies']:.2f} | {r['call_s']:.1f} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="?", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join((BASELINE, *METHODS)))
    ap.add_argument("--limit-gb", type=float, default=12.0, help="address-space limit of each child")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)), flush=True)
        return []
    rows = measured(run_one(model_name, method, args.limit_gb)
                    for model_name in args.models.split(",") for method in args.methods.split(","))
    print(table(rows))
    save_json(rows, args.json)
    return rows


if __name__ == "__main__":
    main()
