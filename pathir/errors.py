"""The exceptions pathir raises. Each names the node, its op and where it came from."""

from __future__ import annotations

__all__ = [
    "PathirError",
    "UnsupportedOperation",
    "GraphVerificationError",
    "PassWroteInput",
    "GraphTooLarge",
    "PathNormOverflow",
    "BackendError",
    "ModelChanged",
    "SelfCheckFailed",
    "InputShapeError",
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentKeyError",
    "MissingFile",
    "RankFailed",
    "StaleReference",
    "PathirWarning",
    "NotConvergedWarning",
]


class PathirError(Exception):
    """Base class of every error pathir raises on purpose."""


class UnsupportedOperation(PathirError):
    """An operation outside the ReLU DAG model (docs/math.md §1) was met while lowering.

    The user's model is never modified when this is raised.
    """

    def __init__(self, node: str, op: str, where: str = "", why: str = ""):
        self.node, self.op, self.where, self.why = node, op, where, why
        text = f"node '{node}' (op {op})"
        if where:
            text += f" from {where}"
        text += " is not supported"
        if why:
            text += f": {why}"
        super().__init__(text)


class GraphVerificationError(PathirError):
    """The graph breaks an invariant of the IR; the message shows the graph."""


class PassWroteInput(GraphVerificationError):
    """A pass wrote into the graph it was given (``graph``: that graph, changed) instead of returning a new one."""

    graph = None


class GraphTooLarge(PathirError):
    """A neuron-level computation was asked of a graph above the size limit."""


class PathNormOverflow(PathirError, OverflowError):
    """A path quantity does not fit in float64; ask for its log10 instead."""


class BackendError(PathirError):
    """A backend failed while evaluating a node; the message names the node."""


class ModelChanged(PathirError):
    """The model a Compiled follows changed in a way it cannot follow (its structure, or
    any change under a snapshot Compiled): compile it again."""


class SelfCheckFailed(PathirError):
    """The compiled IR does not compute what the model computes (compile's self-check);
    the message gives the deviation and the first node where the two disagree."""


class InputShapeError(PathirError, ValueError):
    """``input_shape`` (or ``example_input``) does not fit the model; the message says the expected form."""


class ArgumentError(PathirError, ValueError):
    """An argument of a pathir call is outside its domain (``q=0``, ``max_log_scale=-1``, an
    unknown solver); the message names the argument and what it accepts."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of a pathir call has the wrong type; the message names the argument."""


class ArgumentKeyError(ArgumentError, KeyError):
    """A name given to a pathir call names nothing there (a node, a unit, a param, a pass)."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class MissingFile(PathirError, FileNotFoundError):
    """A file pathir was asked to read does not exist (a model file, a weights file): a PathirError like
    every other problem, and a FileNotFoundError for code that catches that."""


class StaleReference(PathirError):
    """A write-back's function check compared the written model with outputs recorded earlier
    (at compile, or after the last write) and they differ: the model may have changed since in a way
    the record's stamp does not show. ``commit_rescaling`` puts the model back and writes again,
    checked against a fresh forward; users never see it."""


class RankFailed(PathirError):
    """A job split across the ranks of a torch.distributed process group raised on one or more
    ranks; every rank raises this, naming each failing rank and its error."""


class PathirWarning(RuntimeWarning):
    """A result pathir returns but you should know about (it is still exact for what it states)."""


class NotConvergedWarning(PathirWarning):
    """An iterative solver stopped at its iteration limit before its stopping rule held; the report
    says how far it got (the rescaling written is still function-preserving, just not optimal)."""
