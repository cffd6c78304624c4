"""The demo's run checkpoint: the store and the policy saved together, and found again.

``--checkpoint-dir DIR`` writes ``DIR/step-<n>`` (``n``: steps trained) holding

- ``store/``: ``client.checkpoint``: the rollouts already written for the steps
  not trained yet, their declarations and cursors;
- ``policy/weights``, ``policy/optimizer``: ``TQPolicy.save_checkpoint`` (every
  rank's weights, optimizer and RNG states);
- ``manifest.json``: the step to run next, the flags that shape the run, and the
  SHA-256 of both parts' own manifests (which checksum every file below them).

It is written as ``step-<n>.tmp-<random>`` and renamed last: a ``step-<n>``
directory is complete, and a crash mid-save leaves nothing that resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

from policy_workers import checkpoint as ckpt
from policy_workers.errors import CheckpointCorrupt, CheckpointNotFound

FORMAT = ckpt.FORMAT  # written by ckpt.finish
KIND = "dataplane-demo-run"
STORE = "store"
WEIGHTS = os.path.join("policy", "weights")
OPTIMIZER = os.path.join("policy", "optimizer")
# The flags a resumed run must share with the saved one (they decide its data and
# its training); the rest (progress bars, --keep-serving, ...) may differ.
RUN_FLAGS = (
    "steps",
    "prompts_per_step",
    "generations",
    "prompt_len",
    "min_new_tokens",
    "max_new_tokens",
    "dp",
    "tp",
    "packing",
    "mb_tokens",
    "kl_penalty",
    "lr",
    "minibatches",
    "vocab_size",
    "model_path",
    "num_storage_units",
    "async_mode",
    "max_staleness",
)
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def save_run(
    root: str,
    next_step: int,
    flags: dict[str, Any],
    client: Any,
    policy: Any,
    after_policy: Callable[[], None] | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Save the store and the policy as ``root/step-<next_step>``; returns its path.

    ``after_policy`` runs once the policy's files are on disk, before the store is
    saved (the async demo's ``commit_step``: the store checkpoint then holds the mark);
    ``extra``: more manifest entries (the async demo's trained log)."""
    final = os.path.join(os.path.abspath(root), f"step-{next_step}")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = ckpt.start(final)
    try:
        os.makedirs(os.path.join(tmp, "policy"))
        policy.save_checkpoint(
            os.path.join(tmp, WEIGHTS), os.path.join(tmp, OPTIMIZER), step=next_step
        )
        if after_policy is not None:
            after_policy()
        client.checkpoint(os.path.join(tmp, STORE))
        parts = {
            part: {"path": part, "manifest_sha256": _sha256(os.path.join(tmp, part, ckpt.MANIFEST))}
            for part in (STORE, WEIGHTS, OPTIMIZER)
        }
        manifest = {"kind": KIND, "next_step": next_step, "flags": flags, "parts": parts}
        manifest.update(extra or {})
        return ckpt.finish(tmp, final, manifest)
    except BaseException:
        ckpt.abandon(tmp)
        raise


def find_run(path: str) -> str:
    """``path`` itself when it is a run checkpoint, else its latest ``step-<n>``."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, ckpt.MANIFEST)):
        return path
    steps = []
    if os.path.isdir(path):
        for name in os.listdir(path):
            m = _STEP_DIR.match(name)
            if m and os.path.exists(os.path.join(path, name, ckpt.MANIFEST)):
                steps.append((int(m.group(1)), name))
    if not steps:
        raise CheckpointNotFound(f"no demo checkpoint at {path} (nor a step-<n> inside it)")
    return os.path.join(path, max(steps)[1])


def read_run(path: str) -> dict[str, Any]:
    """The run manifest at ``path`` with absolute part paths, each part's manifest checked."""
    try:
        with open(os.path.join(path, ckpt.MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{path}: no readable run manifest ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("kind") != KIND:
        raise CheckpointCorrupt(f"{path} is not a demo run checkpoint")
    for part in manifest["parts"].values():
        part["path"] = os.path.join(path, part["path"])
        try:
            digest = _sha256(os.path.join(part["path"], ckpt.MANIFEST))
        except OSError as e:
            raise CheckpointCorrupt(f"{path}: part {part['path']} unreadable ({e})") from None
        if digest != part["manifest_sha256"]:
            raise CheckpointCorrupt(f"{part['path']}: its manifest is not the one saved")
    return manifest
