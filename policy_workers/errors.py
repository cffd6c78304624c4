"""Typed errors of the policy side (worker loss, checkpoints).

They derive from :class:`dataplane_client.wire.errors.DataPlaneError`, so a trainer
that catches data-plane errors catches these too, and each is also the matching
built-in (NeMo-RL callers catch built-ins): a lost worker is a
``ConnectionError``, a checkpoint that is not there a ``FileNotFoundError``, a
damaged or mismatched one a ``ValueError``. They pickle as themselves, so one
raised inside a worker reaches the driver as the same class.
"""

from __future__ import annotations

from dataplane_client.wire.errors import DataPlaneError


class PolicyWorkerLost(DataPlaneError, ConnectionError):
    """A policy worker died during a call; the worker group is unusable (its
    torch.distributed world lost a member) and has been shut down. Build a new
    policy and load the last checkpoint."""


class PolicyCheckpointError(DataPlaneError, ValueError):
    """Base of the policy checkpoint errors."""


class CheckpointNotFound(PolicyCheckpointError, FileNotFoundError):
    """No checkpoint at that path (or one whose manifest was never written:
    a save that did not finish)."""


class CheckpointCorrupt(PolicyCheckpointError):
    """A file of the checkpoint does not match the size or SHA-256 its manifest records,
    or the manifest itself cannot be read."""


class CheckpointMismatch(PolicyCheckpointError):
    """The checkpoint is intact but belongs to another policy: a different model config,
    world layout (PP x DP x CP x TP), optimizer, or weights than the ones given with it."""
