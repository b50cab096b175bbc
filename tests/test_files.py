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


def test_a_folder_of_files_is_replaced_as_one(tmp_path):
    """files.replace_folder: the new files all at once, the old ones kept where not rewritten; a writer that fails
    half-way (a crash) leaves the previous folder byte for byte, and no staging folder behind."""
    from fastanchor.files import replace_folder

    record = tmp_path / "record"

    def first(folder):
        (folder / "result.json").write_text('{"v": 1}')
        (folder / "README.md").write_text("v1")
        (folder / "result.png").write_bytes(b"png1")

    replace_folder(record, first)
    assert sorted(p.name for p in record.iterdir()) == ["README.md", "result.json", "result.png"]

    def torn(folder):
        (folder / "result.json").write_text('{"v": 2}')
        raise OSError("disk full while writing README.md")

    with pytest.raises(OSError):
        replace_folder(record, torn)
    assert (record / "result.json").read_text() == '{"v": 1}' and (record / "README.md").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["record"]  # nothing staged is left

    def second(folder):
        (folder / "result.json").write_text('{"v": 2}')
        (folder / "README.md").write_text("v2")

    replace_folder(record, second)
    assert (record / "result.json").read_text() == '{"v": 2}' and (record / "README.md").read_text() == "v2"
    assert (record / "result.png").read_bytes() == b"png1" and [p.name for p in tmp_path.iterdir()] == ["record"]


def test_torn_and_foreign_files_are_one_line_naming_them(tmp_path):
    from fastanchor.errors import DataError
    from fastanchor.files import read_json, read_npz, read_text, read_yaml

    (tmp_path / "cut.json").write_text('{"id": {"top1": 9')
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "twice.yaml").write_text("a: 1\na: 2\n")
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04" + bytes(20))
    for call, message in ((lambda: read_json(tmp_path / "cut.json", "eval"), "eval '{t}/cut.json' is not complete JSON"),
                          (lambda: read_text(tmp_path / "latin.txt", "notes"), "notes '{t}/latin.txt' is not UTF-8 text"),
                          (lambda: read_yaml(tmp_path / "twice.yaml", "recipe"), "duplicated key 'a' (line 2)"),
                          (lambda: read_npz(tmp_path / "cut.npz", "scores"), "scores '{t}/cut.npz' is damaged"),
                          (lambda: read_json(tmp_path / "none.json", "eval"), "eval '{t}/none.json' does not exist")):
        with pytest.raises(DataError) as caught:
            call()
        assert message.format(t=tmp_path) in str(caught.value) and "\n" not in str(caught.value)
