"""Checkpoint directories appear whole under their final name, or not at all."""

import os

import pytest

from dataplane_client.wire import atomic_dir


class _Exists(Exception):
    pass


def test_a_directory_with_a_part_folder_inside_is_published_whole(tmp_path):
    final = tmp_path / "step-1"
    tmp = atomic_dir.start(str(final), _Exists)
    assert not final.exists()
    (tmp_path / os.path.basename(tmp) / "manifest.json").write_text("{}")
    part = tmp_path / os.path.basename(tmp) / "policy"  # a run checkpoint nests its parts
    part.mkdir()
    (part / "rank-00000.pt").write_bytes(b"w")
    assert atomic_dir.publish(tmp, str(final)) == str(final)
    assert (final / "manifest.json").read_text() == "{}"
    assert (final / "policy" / "rank-00000.pt").read_bytes() == b"w"
    assert not os.path.exists(tmp)


def test_an_existing_name_is_refused_with_the_callers_error_and_abandon_leaves_nothing(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(_Exists, match="exists"):
        atomic_dir.start(str(tmp_path / "taken"), _Exists)
    tmp = atomic_dir.start(str(tmp_path / "new"), _Exists)
    (tmp_path / os.path.basename(tmp) / "half.bin").write_bytes(b"x")
    atomic_dir.abandon(tmp)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
