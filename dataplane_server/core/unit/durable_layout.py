"""Where a durable service keeps its state, and whether the place fits the level (no Ray).

- ``process``: each unit's chunk files and row index on RAM, under
  ``/dev/shm/dataplane-<digest of state_dir>/unit-<i>`` (they survive any process's
  death, not a reboot); the controller's journal under ``state_dir/controller``.
- ``machine``: all of it on the disk under ``state_dir`` (``units/unit-<i>``,
  ``controller``), flushed per ``fsync_policy``.

The same ``state_dir`` always maps to the same places, so a service started again
with it (``dataplane serve --state-dir``, ``start()``) finds everything.
"""

from __future__ import annotations

import hashlib
import os
import shutil

from dataplane_client.wire.config import DataPlaneConfig
from dataplane_client.wire.errors import ConfigError
from dataplane_server.core.unit.chunk_files import ChunkFiles
from dataplane_server.core.unit.row_log import RowLog

SHM_ROOT = "/dev/shm"
_RAM_FILESYSTEMS = {"tmpfs", "ramfs"}


def is_durable(config: DataPlaneConfig) -> bool:
    return config.durability != "memory"


def controller_dir(config: DataPlaneConfig) -> str | None:
    """The controller's journal directory: the one named, else under ``state_dir``."""
    if config.controller_state_dir:
        return config.controller_state_dir
    return os.path.join(config.state_dir, "controller") if config.state_dir else None


def unit_dir(config: DataPlaneConfig, index: int) -> str:
    """Where unit ``index`` keeps its chunk files and row index."""
    assert config.state_dir, "a durable level needs state_dir (the config checks it)"
    if config.durability == "process":
        digest = hashlib.sha1(os.path.realpath(config.state_dir).encode()).hexdigest()[:12]
        return os.path.join(SHM_ROOT, f"dataplane-{digest}", f"unit-{index}")
    return os.path.join(config.state_dir, "units", f"unit-{index}")


def open_unit(config: DataPlaneConfig, index: int) -> tuple[ChunkFiles | None, RowLog | None]:
    """A unit's chunk files and row log (None, None at durability ``memory``)."""
    if not is_durable(config):
        return None, None
    root = unit_dir(config, index)
    machine = config.durability == "machine"
    sync = config.fsync_policy if machine else "none"
    return (
        ChunkFiles(os.path.join(root, "chunks"), prefault=not machine, recycle=not machine),
        RowLog(os.path.join(root, "index"), sync, config.fsync_interval_s),
    )


def filesystem_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) holding ``path`` (as ``findmnt -T`` says)."""
    real = os.path.realpath(path)
    best = ("/", "")
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, parts[2])
    return best


def check(config: DataPlaneConfig) -> None:
    """ConfigError when the state directory cannot hold what the level promises."""
    if not is_durable(config):
        return
    assert config.state_dir
    if config.durability == "machine":
        mount, fstype = filesystem_of(config.state_dir)
        if fstype in _RAM_FILESYSTEMS:
            raise ConfigError(
                f"durability 'machine' needs state_dir on a disk; {config.state_dir!r} is on "
                f"{fstype} ({mount}), which a reboot empties (use durability 'process' there)",
                fields=["state_dir", "durability"],
            )
    try:
        os.makedirs(config.state_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"state_dir {config.state_dir!r} cannot be made: {exc}", fields=["state_dir"]
        ) from None
    if not os.access(config.state_dir, os.W_OK):
        raise ConfigError(f"state_dir {config.state_dir!r} is not writable", fields=["state_dir"])
    if config.durability == "process" and not os.path.isdir(SHM_ROOT):
        raise ConfigError(
            f"durability 'process' keeps its files in {SHM_ROOT}, which this machine lacks",
            fields=["durability"],
        )


def shm_root(config: DataPlaneConfig) -> str | None:
    """The directory of every unit's files on RAM (durability ``process``), else None."""
    if config.durability != "process":
        return None
    return os.path.dirname(unit_dir(config, 0))


def remove_state(config: DataPlaneConfig) -> None:
    """Delete a durable service's state for good: its RAM files and ``state_dir``."""
    for path in (shm_root(config), config.state_dir):
        if path:
            shutil.rmtree(path, ignore_errors=True)
