"""Directories that appear whole or not at all (store and policy checkpoints).

Everything is written into ``<dir>.tmp-<random>`` beside the final name, every file
is fsynced, and only then is the directory renamed to ``<dir>`` (and the rename
synced): a crash mid-save leaves no directory of the final name, only a temporary one
that nothing loads. Writers that sync their own files (a store checkpoint's units)
call ``rename_into_place`` instead of ``publish``.
"""

from __future__ import annotations

import os
import shutil
import uuid


def start(directory: str, error: type[Exception]) -> str:
    """A fresh temporary directory beside ``directory``; raises ``error`` if it exists."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory):
        raise error(f"checkpoint directory {directory} exists; choose a new one")
    tmp = f"{directory}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    return tmp


def publish(tmp: str, directory: str) -> str:
    """Sync every file directly in ``tmp``, then rename it to ``directory``; returns its
    absolute path. A folder inside (a part published the same way) was synced by its own."""
    for entry in os.scandir(tmp):
        if entry.is_file(follow_symlinks=False):
            with open(entry.path, "rb") as f:
                os.fsync(f.fileno())
    return rename_into_place(tmp, directory)


def rename_into_place(tmp: str, directory: str) -> str:
    """Rename ``tmp``, whose files are synced already, to ``directory``, with its entries
    and the rename made durable; returns its absolute path."""
    sync_dir(tmp)
    directory = os.path.abspath(directory)
    os.rename(tmp, directory)
    sync_dir(os.path.dirname(directory))  # the rename itself
    return directory


def write_synced(path: str, data: bytes) -> None:
    """A new file holding ``data``, synced before it returns."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(path: str) -> None:
    """Make a directory's entries (files made, renamed, removed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def abandon(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
