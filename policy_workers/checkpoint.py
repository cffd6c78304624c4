"""Policy checkpoint directories: layout, manifest, checksums (no Ray here).

A policy checkpoint is one directory per part, as NeMo-RL's
``save_checkpoint(weights_path, optimizer_path)`` splits them:

- weights: ``rank-<r>.pt`` per worker, that rank's ``state_dict`` as the model
  code lays it out (the replicated body, and under TP only the rank's rows of
  the vocab-parallel head); DP replicas each write their own copy;
- optimizer: ``rank-<r>.pt`` per worker, the optimizer's ``state_dict`` plus the
  rank's RNG states, so training continues exactly where it stopped;
- ``manifest.json`` in each: format, part, world layout, model config, the
  step the caller reached, an id tying an optimizer part to the weights it was
  saved with, and every file with its size and SHA-256.

Each part is written into ``<dir>.tmp-<random>`` and renamed to ``<dir>`` only
once every rank's file and the manifest are on disk (fsynced): a crash mid-save
leaves no directory of the final name, and a directory without a readable
manifest never loads. Loading checks every file against the manifest before the
file is unpickled (``torch.load(weights_only=True)``: tensors and plain
containers only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import random
from typing import Any

import torch

from dataplane_client.wire import atomic_dir
from policy_workers.errors import (
    CheckpointCorrupt,
    CheckpointMismatch,
    CheckpointNotFound,
    PolicyCheckpointError,
)

FORMAT = 1
MANIFEST = "manifest.json"
WEIGHTS = "weights"
OPTIMIZER = "optimizer"
# Model config fields that do not change the saved tensors (a checkpoint loads under either).
_MODEL_FIELDS_IGNORED = ("attn_implementation",)


def shard_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def start(directory: str) -> str:
    return atomic_dir.start(directory, PolicyCheckpointError)


def write_shard(tmp: str, rank: int, obj: Any) -> dict[str, Any]:
    """Write one rank's object into ``tmp``; returns its manifest entry (name, size, SHA-256)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    name = shard_name(rank)
    with open(os.path.join(tmp, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {
        "rank": rank,
        "name": name,
        "nbytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def finish(tmp: str, directory: str, manifest: dict[str, Any]) -> str:
    """Write the manifest into ``tmp``, sync it, rename ``tmp`` to ``directory``."""
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, **manifest}, f, indent=1)
    return atomic_dir.publish(tmp, directory)


abandon = atomic_dir.abandon


def read_manifest(directory: str, part: str) -> dict[str, Any]:
    """The manifest of the ``part`` checkpoint at ``directory``, checked for format and part."""
    directory = os.path.abspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointNotFound(f"no policy {part} checkpoint at {directory}")
    if not os.path.exists(path):
        raise CheckpointNotFound(
            f"{directory} has no {MANIFEST}: not a policy checkpoint, or a save that never finished"
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{path} is not a readable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointCorrupt(f"{path} is not a checkpoint manifest (a JSON object)")
    if manifest.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{path}: unknown checkpoint format {manifest.get('format')!r}")
    if manifest.get("part") != part:
        raise CheckpointMismatch(
            f"{directory} holds the policy's {manifest.get('part')!r}, not its {part!r}"
        )
    return manifest


def read_shard(directory: str, entry: dict[str, Any]) -> Any:
    """One rank's object, after checking its bytes against the manifest ``entry``."""
    path = os.path.join(os.path.abspath(directory), entry["name"])
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointCorrupt(f"cannot read {path} ({e})") from None
    if len(data) != entry["nbytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointCorrupt(
            f"{path} does not match its manifest ({len(data)} bytes, "
            f"{entry['nbytes']} recorded, or another SHA-256)"
        )
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def model_fingerprint(model_cfg: Any) -> dict[str, Any]:
    """The model config fields that decide the saved tensors, JSON-ready."""
    fields = dataclasses.asdict(model_cfg)
    return {k: v for k, v in fields.items() if k not in _MODEL_FIELDS_IGNORED}


def check_matches(manifest: dict[str, Any], directory: str, **expected: Any) -> None:
    """Raise :class:`CheckpointMismatch` naming every key where ``manifest`` differs."""
    diffs = []
    for key, want in expected.items():
        have = manifest.get(key)
        if isinstance(want, dict) and isinstance(have, dict):
            keys = sorted(set(want) | set(have))
            diffs += [
                f"{key}.{k}: {have.get(k)!r} saved, {want.get(k)!r} here"
                for k in keys
                if have.get(k) != want.get(k)
            ]
        elif have != want:
            diffs.append(f"{key}: {have!r} saved, {want!r} here")
    if diffs:
        raise CheckpointMismatch(
            f"the checkpoint at {os.path.abspath(directory)} belongs to another policy: "
            + "; ".join(diffs)
        )


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, every CUDA device, Python's ``random``)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
