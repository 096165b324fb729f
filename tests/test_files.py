"""pathir.support.files.write_atomic: the umask's mode, all or nothing."""

import os

import pytest

from pathir.support.files import write_atomic


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o000])
def test_mode_follows_the_umask_and_the_umask_is_kept(umask, tmp_path):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "f.bin", lambda f: f.write(b"x"))
        assert os.umask(umask) == umask  # read, not changed
    finally:
        os.umask(old)
    assert (tmp_path / "f.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_failure_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomic(target, fail)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    write_atomic(target, lambda f: f.write(b"new"))
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["f.bin"]
