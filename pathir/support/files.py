"""Files pathir writes: all or nothing, with the permissions the process umask gives.

:func:`write_atomic` writes through a temporary file in the target's folder and
``os.replace``: a failure (or an interrupt) leaves no file and no stale
temporary; an existing file is replaced in one step. The temporary file, made
0600 by ``tempfile.mkstemp``, gets the mode a plain ``open(path, "w")`` would
give (0666 less the umask) before the rename.

>>> import os, tempfile
>>> folder = tempfile.mkdtemp()
>>> write_atomic(os.path.join(folder, "a.txt"), lambda f: f.write(b"hi"))
>>> open(os.path.join(folder, "a.txt"), "rb").read(), os.listdir(folder)
(b'hi', ['a.txt'])
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["write_atomic", "default_mode", "same_file"]


def default_mode() -> int:
    """0o666 less the process umask (read without changing it where the platform allows)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def write_atomic(path, write) -> None:
    """Call ``write(f)`` on a binary file that becomes ``path`` only once ``write`` returned."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"'{path}' is a folder: name the file to write")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no such folder: '{folder}' (to write '{path}')")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    except OSError as err:  # named by the file asked for, not the temporary one beside it
        raise type(err)(err.errno, err.strerror, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, default_mode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def same_file(path, other) -> bool:
    """Whether ``path`` and ``other`` (None: no file) name one existing file (through links and ``./``): an
    output that would overwrite what was read."""
    return other is not None and os.path.isfile(path) and os.path.isfile(other) and os.path.samefile(path, other)
