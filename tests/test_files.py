"""Atomic writes (fastanchor/files.py): the target is the old file or the new one, never torn; no temporary left."""

import os
import stat

import pytest
from fastanchor.files import atomic_path, atomic_write_bytes


def leftovers(directory):
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_atomic_write_bytes_replaces_the_target(tmp_path):
    target = tmp_path / "sub" / "result.json"
    atomic_write_bytes(target, lambda handle: handle.write(b"first"))
    atomic_write_bytes(target, lambda handle: handle.write(b"second"))
    assert target.read_bytes() == b"second" and leftovers(target.parent) == []
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # as open() would have made it, not mkstemp's 0600


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "checkpoint.pt"
    target.write_bytes(b"old")

    def half_then_fail(handle):
        handle.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, half_then_fail)
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []


def test_atomic_path_for_writers_that_open_the_file_by_name(tmp_path):
    target = tmp_path / "data.beton"
    with atomic_path(target, mode=0o644) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".data.beton.") and not target.exists()
        tmp.write_bytes(b"pages")
    assert target.read_bytes() == b"pages" and leftovers(tmp_path) == []
    assert stat.S_IMODE(target.stat().st_mode) & 0o022 == 0  # never group- or world-writable
    with pytest.raises(ValueError), atomic_path(target) as tmp:
        tmp.write_bytes(b"torn")
        raise ValueError("verification failed")
    assert target.read_bytes() == b"pages" and leftovers(tmp_path) == []
