"""postrl.io.load_once: what a file holds, built once per process and again when the file changes."""

from __future__ import annotations

import os

import pytest

from postrl.io import load_once


def test_built_once_per_file_and_key_and_again_when_the_file_changes(tmp_path):
    f = tmp_path / "corpus.jsonl"
    f.write_text("a\n")
    calls = []

    def build():
        calls.append(f.read_text())
        return len(calls)

    assert load_once(f, build, "x") == 1 and load_once(f, build, "x") == 1  # cached
    assert load_once(f, build, "y") == 2  # another key
    f.write_text("b\n")
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a later modification time, whatever the clock
    assert load_once(f, build, "x") == 3 and calls[-1] == "b\n"  # re-written: built again


def test_a_failed_build_is_not_cached_and_nested_loads_work(tmp_path):
    f, g = tmp_path / "a", tmp_path / "b"
    f.write_text("1")
    g.write_text("2")

    def boom():
        raise ValueError("bad file")

    with pytest.raises(ValueError, match="bad file"):
        load_once(f, boom)
    assert load_once(f, lambda: "ok") == "ok"
    # a build that loads another file (an encoder for a corpus) does not deadlock
    assert load_once(g, lambda: load_once(f, lambda: "inner", "k") + "+outer") == "inner+outer"
