"""The abstract data-plane client: NeMo-RL's ``DataPlaneClient`` contract.

NeMo-RL's trainer and workers talk to a data plane only through these eight
methods and :class:`~dataplane_client.meta.KVBatchMeta`. Code written against
this class runs on any implementation of it. Implementations may add methods
and keyword arguments after these (ours: async twins, leases, ``ack``, object
fields), but never change what these do. Errors are the typed classes of
``dataplane_client.errors``, each also the built-in named below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dataplane_client.meta import KVBatchMeta

if TYPE_CHECKING:
    from tensordict import TensorDict


class DataPlaneClient(ABC):
    """Per-sample storage keyed by ``(partition_id, sample_id)``, with task-mediated claims."""

    # ---- A. task-mediated ----------------------------------------------------------
    @abstractmethod
    def register_partition(
        self,
        partition_id: str,
        fields: Sequence[str],
        num_samples: int,
        consumer_tasks: Sequence[str],
        grpo_group_size: int | None = None,
        enums: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        """Declare a partition: its fields, expected sample count and consumer tasks.

        Registering an existing id again overwrites it cleanly (retries
        re-register). ``enums`` maps a field to a fixed vocabulary of strings,
        shipped once, so that string column travels as integer codes.
        """

    @abstractmethod
    def claim_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        dp_rank: int | None = None,
        blocking: bool = True,
        timeout_s: float = 60.0,
    ) -> KVBatchMeta:
        """Claim up to ``batch_size`` samples ready for ``task_name``.

        A sample is ready when every field of ``required_fields`` is produced
        and ``task_name`` has not consumed it; the claim advances the task's
        cursor, so a claimed id is not returned to that task again. A task not
        registered for the partition raises ``KeyError`` naming it; a blocking
        claim that runs out of time raises ``TimeoutError``.
        """

    @abstractmethod
    def get_data(self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None) -> TensorDict:
        """Fetch the rows of ``meta`` as a TensorDict with ``batch_size=[meta.size]``.

        Fields read are ``select_fields``, else ``meta.fields``; with neither,
        ``ValueError`` (never every field silently). Rows come back in
        ``meta.sample_ids`` order.
        """

    @abstractmethod
    def check_consumption_status(self, partition_id: str, task_names: Sequence[str]) -> bool:
        """True iff every named task has consumed every sample of the partition."""

    # ---- B. direct-by-key ----------------------------------------------------------
    @abstractmethod
    def put_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        fields: Any = None,
        tags: Sequence[dict] | None = None,
    ) -> KVBatchMeta:
        """Write fields of samples; returns a meta covering ``sample_ids``.

        ``fields`` is a TensorDict (plain dicts and BatchedDataDict are accepted
        too) of one row per id. Each write flips the produced bit of (sample,
        field), the signal that a stage is done. A non-tensor leaf raises
        ``TypeError`` saying "non-tensor"; strings travel through ``enums``.
        """

    @abstractmethod
    def get_samples(
        self, sample_ids: Sequence[str], partition_id: str, select_fields: Sequence[str]
    ) -> TensorDict:
        """Read fields of samples by id, in request order; touches no consumption cursor.

        Unknown or cleared ids, and fields not produced, raise ``KeyError``.
        """

    @abstractmethod
    def clear_samples(self, sample_ids: Sequence[str] | None, partition_id: str) -> None:
        """Drop the given samples; ``None`` drops the whole partition, so that the
        next ``register_partition`` of the same id starts clean."""

    # ---- C. lifecycle ----------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Release handles. Idempotent."""
