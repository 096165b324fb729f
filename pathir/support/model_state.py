"""A refused call leaves the model as it was: what tracing can write, kept and put back.

Compiling a torch model runs its Python forward: fx symbolic tracing, the torch.export
fallback, the error explanation (a forward on zeros) and the self-check (a forward on a
random batch); a query that re-lowers a changed model traces it again. A forward can write
the model while it runs: ``F.batch_norm(..., training=True)`` updates its running statistics,
``self.count += 1`` rebinds an attribute, ``self.weight.data.mul_(2)`` writes a weight.
:func:`kept` runs such a call and puts the model back as it was:

- **module attributes**: each module's ``__dict__`` (shallow: the objects its names are bound
  to, the training flag among them) and one level into its dicts, sets and lists, which
  holds ``_parameters``, ``_buffers``, ``_modules`` and the hook tables: names added are
  removed, names rebound are bound again, so the same tensor objects stay registered;
- **tensors** (parameters, buffers, their ``.grad``, tensors kept as plain attributes):
  identity, dtype, device, shape, storage and ``requires_grad`` (a ``.data = ...``
  replacement is undone through ``.data``), the values bit for bit and autograd's version
  counter. Values are put back in place (``t.data.copy_``), so references to the tensors,
  an optimizer's state and autograd graphs that saved them stay valid.

Cost. Buffers are copied when the call starts (they are small: running statistics,
counters). Parameters are not: a ``TorchDispatchMode`` sees every ATen op that the call runs
and, before the first op that writes (schema ``Tensor(a!)``: in-place ops, ``out=``,
batch-norm's running statistics, a write through ``.data`` or a view) into a parameter's
storage, copies that parameter (copy on write). A call that writes no parameter, which is
every accepted one, copies none, so compile's peak memory does not grow. Writes that bypass
PyTorch's dispatcher (through a NumPy view of a tensor, ctypes) are not seen; a buffer's are
still undone (it is compared with its copy), a parameter's are not.

On success, attributes are put back too (a Python counter the forward moved); a tensor written
during an accepted call is put back and the call is refused (:class:`UnsupportedOperation`):
the traced graph does not show the write and every call would change the model.

>>> import torch, torch.nn as nn, torch.nn.functional as F
>>> class Stats(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.fc = nn.Linear(3, 4)
...         self.register_buffer("mean", torch.zeros(4))
...         self.register_buffer("var", torch.ones(4))
...     def forward(self, x):
...         self.calls = getattr(self, "calls", 0) + 1
...         return F.batch_norm(self.fc(x), self.mean, self.var, training=True)
>>> net = Stats()
>>> weight = net.fc.weight.detach().clone()
>>> try:
...     with kept(net):
...         _ = net(torch.randn(5, 3))          # writes mean and var, sets net.calls
...         _ = net.fc.weight.data.mul_(2)      # no version bump: seen all the same
...         raise RuntimeError("refused")
... except RuntimeError:
...     pass
>>> bool((net.mean == 0).all()), torch.equal(net.fc.weight, weight), hasattr(net, "calls")
(True, True, False)
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass

from pathir.errors import UnsupportedOperation

__all__ = ["kept", "keeps_model", "ModelState"]

def _torch_module(model) -> bool:
    torch = sys.modules.get("torch")  # no torch imported: not a torch model
    return torch is not None and isinstance(model, torch.nn.Module)


@contextlib.contextmanager
def kept(model):
    """Run the body with ``model``'s state kept (module docstring); put it back on any error,
    and on success refuse (after putting it back) if a tensor of the model was written."""
    if not _torch_module(model):
        yield
        return
    state = ModelState(model)
    try:
        with state.watching():
            yield
    except BaseException:
        state.restore()
        raise
    written = state.restore()
    if written:
        raise UnsupportedOperation(
            "forward", type(model).__name__, "",
            f"the forward writes the model's own {', '.join(repr(n) for n in written[:5])} while it runs "
            "(e.g. batch_norm with training=True, an edit through .data): the traced graph does not show it "
            "and every call would change the model (put back as it was; keep state updates out of forward, "
            "or under `if self.training`)")


def keeps_model(fn):
    """Decorate ``fn(model, ...)`` to run under :func:`kept` (``model`` its first argument)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        model = args[0] if args else kwargs.get("model")
        with kept(model):
            return fn(*args, **kwargs)

    return wrapper


@dataclass
class _Tensor:
    """One tensor of the model as it was: the object, an alias of its storage, its metadata."""

    name: str
    obj: object
    alias: object  # t.detach(): the same storage, offset, shape and strides (None: not a real tensor)
    where: tuple  # storage pointer, offset, shape, stride, dtype, device
    requires_grad: bool
    version: int | None
    copy: object = None  # a buffer's values, copied at start; a parameter's, copied before its first write
    written: bool = False  # an ATen op wrote its storage


def _where(t) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _version(t) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def _same_bits(a, b) -> bool:
    """Equal bit for bit (a NaN equals the same NaN, -0.0 differs from 0.0)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    try:
        return torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))
    except (KeyError, RuntimeError):
        return torch.equal(a, b)


def _contents(v):
    """A shallow copy of a container attribute's contents (None: not one of dict, set, list)."""
    if isinstance(v, dict) and type(v).__module__ in ("builtins", "collections"):
        return list(v.items())
    if type(v) in (set, list):
        return list(v)
    return None


def _same_contents(obj, old) -> bool:
    now = list(obj.items()) if isinstance(obj, dict) else list(obj)
    if isinstance(obj, dict):
        return len(now) == len(old) and all(a[0] == b[0] and a[1] is b[1] for a, b in zip(now, old))
    if isinstance(obj, set):
        return obj == set(old)
    return len(now) == len(old) and all(a is b for a, b in zip(now, old))


def _put_contents(obj, old) -> None:
    if isinstance(obj, list):
        obj[:] = old
    else:
        obj.clear()
        obj.update(old)


class ModelState:
    """What a call could write in ``model``, recorded; :meth:`restore` puts it back."""

    def __init__(self, model):
        import torch
        from torch.nn.parameter import UninitializedTensorMixin

        self.dicts = []
        for m in model.modules():
            saved = dict(m.__dict__)
            contents = {k: c for k, v in saved.items() if (c := _contents(v)) is not None}
            self.dicts.append((m, saved, contents))
        params = list(model.named_parameters(remove_duplicate=False))
        buffers = list(model.named_buffers(remove_duplicate=False))
        named = [*params, *buffers, *((f"{n}.grad", p.grad) for n, p in params if p.grad is not None),
                 *((f"{path}.{k}" if path else k, v) for path, m in model.named_modules()
                   for k, v in m.__dict__.items() if isinstance(v, torch.Tensor))]
        buffer_ids = {id(t) for _, t in buffers}
        self.grads = [(p, p.grad) for _, p in params]
        self.tensors: dict[int, _Tensor] = {}
        self.owners: dict[int, list[_Tensor]] = {}  # storage pointer -> the model's tensors on it
        with torch.no_grad():
            for name, t in named:
                if id(t) in self.tensors:
                    continue
                if isinstance(t, UninitializedTensorMixin) or t.device.type == "meta" or t.layout != torch.strided:
                    # (no storage to watch: a sparse .grad, which no forward writes in place; its replacement is
                    # seen through self.grads)
                    self.tensors[id(t)] = _Tensor(name, t, None, (), t.requires_grad, None)
                    continue
                rec = _Tensor(name, t, t.detach(), _where(t), t.requires_grad, _version(t),
                              t.detach().clone() if id(t) in buffer_ids else None)
                self.tensors[id(t)] = rec
                if rec.where[0]:
                    self.owners.setdefault(rec.where[0], []).append(rec)

    def watching(self):
        """A context in which every ATen op that writes a storage of the model is seen first
        (:meth:`before_write`)."""
        return _write_watch()(self)

    def before_write(self, t) -> None:
        """An ATen op is about to write ``t``: copy the model's tensors on its storage (once)."""
        if t.device.type == "meta":
            return
        recs = self.owners.get(t.untyped_storage().data_ptr())
        for rec in recs or ():
            rec.written = True
            if rec.copy is None:
                rec.copy = rec.alias.clone()

    def restore(self) -> list[str]:
        """Put the model back as it was; the names of the tensors that had changed."""
        import torch

        for m, saved, contents in self.dicts:
            now = m.__dict__
            for k in [k for k in now if k not in saved]:
                del now[k]
            for k, v in saved.items():
                if k not in now or now[k] is not v:
                    now[k] = v
            for k, old in contents.items():
                if not _same_contents(saved[k], old):
                    _put_contents(saved[k], old)
        changed = []
        with torch.no_grad():
            for rec in self.tensors.values():
                t, moved = rec.obj, False
                if rec.alias is None:
                    continue
                if _where(t) != rec.where:
                    t.data = rec.alias
                    moved = True
                if rec.copy is not None and (rec.written or not _same_bits(t.detach(), rec.copy)):
                    t.data.copy_(rec.copy)  # through .data: the version counter is set below
                    moved = True
                if t.requires_grad != rec.requires_grad and t.is_leaf:
                    t.requires_grad_(rec.requires_grad)
                    moved = True
                version = _version(t)
                if version != rec.version and rec.version is not None:
                    torch._C._autograd._unsafe_set_version_counter((t,), (rec.version,))
                    moved = True
                if moved:
                    changed.append(rec.name)
        for p, grad in self.grads:
            if p.grad is not grad:
                p.grad = grad
        return changed


@functools.cache
def _write_watch():
    """The TorchDispatchMode class (made on first use: importing this module imports no torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    writes: dict = {}  # op -> its arguments that it writes: (position or None, name)

    def written(func):
        if func not in writes:
            writes[func] = [(None if a.kwarg_only else i, a.name) for i, a in enumerate(func._schema.arguments)
                            if a.alias_info is not None and a.alias_info.is_write]
        return writes[func]

    from torch._ops import HigherOrderOperator

    class WriteWatch(TorchDispatchMode):
        supports_higher_order_operators = True  # torch.cond & co. run as they are: their branches write nothing

        def __init__(self, state: ModelState):
            super().__init__()
            self.state = state

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, HigherOrderOperator):
                return func(*args, **kwargs)
            for i, name in written(func):
                arg = args[i] if i is not None and i < len(args) else kwargs.get(name)
                for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                    if _plain(t):
                        self.state.before_write(t)
            return func(*args, **kwargs)

    return WriteWatch


def _plain(t) -> bool:
    """A real tensor (not a fake or functional one of torch.export, whose storage is not the model's)."""
    import torch

    return isinstance(t, torch.Tensor) and type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
