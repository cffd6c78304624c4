"""The abstract data-plane client: NeMo-RL's ``DataPlaneClient`` contract.

NeMo-RL's trainer and workers talk to a data plane only through these eight
methods and :class:`~dataplane_client.wire.meta.KVBatchMeta`. Code written against
this class runs on any implementation of it. Implementations may add methods
and keyword arguments after these (ours: async twins, leases, ``ack``, object
fields), but never change what these do. Errors are the typed classes of
``dataplane_client.wire.errors``, each also the built-in named below.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dataplane_client.wire.messages import (
    Capabilities,
    ClearResult,
    PartitionDescription,
    RolloutGrant,
    ServiceInfo,
    TaskConsumption,
)
from dataplane_client.wire.meta import KVBatchMeta

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
        claim that runs out of time raises ``TimeoutError``; a non-blocking one
        with nothing ready returns an empty meta (``len() == 0``, falsy).
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


class DataPlaneService(DataPlaneClient):
    """``DataPlaneClient`` plus the extras both of our clients offer, typed.

    ``RayDataPlaneClient`` and ``InProcessDataPlaneClient`` implement this, so code may
    rely on these verbs without naming an implementation. It changes nothing of the
    eight contract methods above (NeMo-RL's). The extras:

    - ``delete_partition``: the partition's samples, bytes and declaration gone.
    - ``ack``: a leased claim (or a slice of it) done for its task.
    - ``reset_consumption``: every sample claimable again by a task.
    - ``consumption_detail``: per task, consumed / total / expected, leases, redeliveries.
    - ``describe_partition``: fields, produced counts, consumption, bytes per unit.
    - ``service_info``: units, samples, bytes held and capacity (what rollout actors
      back off on).
    - ``get_data`` / ``get_samples`` take ``device=``: the batch read to a GPU (or CPU).

    Ray-only extras, not declared here: ``checkpoint`` / ``restore`` (the in-process
    store has no files to save), ``list_partitions`` and the admin endpoint's views.

    Awaitable twins: every verb ``v`` has ``v_async``. The defaults here run the
    verb in a worker thread (``asyncio.to_thread``), so a blocking claim never stalls
    the event loop; the in-process client uses them as they are, the Ray client
    overrides them with non-blocking twins that await Ray ObjectRefs. The contract
    verbs' twins pass their arguments on as given (implementations take keyword
    extras after the contract's, e.g. ``task_leases``, ``overwrite``, ``claim_policy``).
    """

    # ---- the contract's reads, to a device (ours: one keyword more) ------------------
    @abstractmethod
    def get_data(
        self, meta: KVBatchMeta, select_fields: Sequence[str] | None = None, device: Any = None
    ) -> TensorDict:
        """``DataPlaneClient.get_data``. ``device`` (``'cpu'``, ``'cuda'``, ``'cuda:<i>'`` or
        a ``torch.device``): the TensorDict and its tensors on that device, copied there
        straight from where the rows lie (host-to-device from pinned memory on a GPU, one
        wait for the whole batch). None, the default: in host memory, zero-copy where the
        rows allow. Any other value: ``InvalidBatch`` naming ``device``."""

    @abstractmethod
    def get_samples(
        self,
        sample_ids: Sequence[str],
        partition_id: str,
        select_fields: Sequence[str],
        device: Any = None,
    ) -> TensorDict:
        """``DataPlaneClient.get_samples``; ``device`` as in :meth:`get_data`."""

    # ---- extras --------------------------------------------------------------------
    @abstractmethod
    def delete_partition(self, partition_id: str) -> ClearResult:
        """Delete the partition (samples, bytes, declaration); what was freed.
        An unknown partition raises ``UnknownPartition`` (a ``KeyError``)."""

    @abstractmethod
    def ack(self, meta: KVBatchMeta) -> int:
        """Acknowledge a leased claim (or a slice of it); returns how many samples the
        ack completed. Once another claim holds them, raises ``LeaseExpired``."""

    @abstractmethod
    def reset_consumption(self, partition_id: str, task_name: str) -> None:
        """Make every sample of the partition claimable again by the task."""

    @abstractmethod
    def consumption_detail(
        self, partition_id: str, task_names: Sequence[str]
    ) -> list[TaskConsumption]:
        """Per named task, in order: consumed / total / expected, leases, redeliveries."""

    @abstractmethod
    def describe_partition(self, partition_id: str) -> PartitionDescription:
        """The partition's fields (and how many samples produced each), consumption per
        task, claims waiting and bytes per storage unit."""

    @abstractmethod
    def service_info(self) -> ServiceInfo:
        """The service's storage units (alive, bytes, samples, capacity) and totals."""

    # ---- async RL (a partition registered with a StalenessSpec) ---------------------
    @abstractmethod
    def set_policy_version(self, partition_id: str, version: int) -> int:
        """Publish the trainer's policy version; below the current one: VersionRegression.
        Samples now older than a task's window are dropped (when the partition drops them)."""

    @abstractmethod
    def policy_version(self, partition_id: str) -> int:
        """The partition's current policy version (0 until set)."""

    @abstractmethod
    def admit_rollouts(
        self,
        partition_id: str,
        n: int,
        *,
        wait: bool = False,
        timeout_s: float = 60.0,
        lease_s: float = 300.0,
    ) -> RolloutGrant | None:
        """Leave to start ``n`` trajectories now, while samples started and not trained stay
        within ``(max_staleness + 1) * admission_batch``: a grant; None when there is no room
        and ``wait`` is False; AdmissionTimeout when waiting ran out."""

    @abstractmethod
    def release_rollouts(self, grant: RolloutGrant) -> bool:
        """The grant's samples are put (or abandoned): it stops counting. False: it had
        expired or was released already."""

    @abstractmethod
    def evict_samples(self, sample_ids: Sequence[str], partition_id: str) -> int:
        """Evict samples by id (counted as evicted); returns how many."""

    @abstractmethod
    def clear_versions(self, partition_id: str, lowest: int, highest: int) -> ClearResult:
        """Retire whole generations: every sample whose version is in [lowest, highest]."""

    @abstractmethod
    def peek_meta(
        self,
        partition_id: str,
        task_name: str,
        required_fields: Sequence[str],
        batch_size: int,
        *,
        where: Any = None,
        max_staleness: int | None = None,
    ) -> KVBatchMeta:
        """The batch ``claim_meta`` would hand out now, claiming nothing (empty: none)."""

    @abstractmethod
    def ready_depth(
        self, partition_id: str, task_names: Sequence[str], required_fields: Sequence[str] = ()
    ) -> dict[str, int]:
        """Per task: how many samples it could claim now (within its staleness window)."""

    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What this implementation supports: verbs, claim policies, filter operators."""

    @abstractmethod
    def ping(self) -> bool:
        """True when the service answers."""

    # ---- awaitable twins of the extras ---------------------------------------------
    async def delete_partition_async(self, partition_id: str) -> ClearResult:
        return await asyncio.to_thread(self.delete_partition, partition_id)

    async def ack_async(self, meta: KVBatchMeta) -> int:
        return await asyncio.to_thread(self.ack, meta)

    async def reset_consumption_async(self, partition_id: str, task_name: str) -> None:
        await asyncio.to_thread(self.reset_consumption, partition_id, task_name)

    async def consumption_detail_async(
        self, partition_id: str, task_names: Sequence[str]
    ) -> list[TaskConsumption]:
        return await asyncio.to_thread(self.consumption_detail, partition_id, task_names)

    async def describe_partition_async(self, partition_id: str) -> PartitionDescription:
        return await asyncio.to_thread(self.describe_partition, partition_id)

    async def service_info_async(self) -> ServiceInfo:
        return await asyncio.to_thread(self.service_info)

    async def set_policy_version_async(self, partition_id: str, version: int) -> int:
        return await asyncio.to_thread(self.set_policy_version, partition_id, version)

    async def policy_version_async(self, partition_id: str) -> int:
        return await asyncio.to_thread(self.policy_version, partition_id)

    async def admit_rollouts_async(self, *args: Any, **kwargs: Any) -> RolloutGrant | None:
        return await asyncio.to_thread(self.admit_rollouts, *args, **kwargs)

    async def release_rollouts_async(self, grant: RolloutGrant) -> bool:
        return await asyncio.to_thread(self.release_rollouts, grant)

    async def evict_samples_async(self, sample_ids: Sequence[str], partition_id: str) -> int:
        return await asyncio.to_thread(self.evict_samples, sample_ids, partition_id)

    async def clear_versions_async(self, partition_id: str, lowest: int, highest: int) -> Any:
        return await asyncio.to_thread(self.clear_versions, partition_id, lowest, highest)

    async def peek_meta_async(self, *args: Any, **kwargs: Any) -> KVBatchMeta:
        return await asyncio.to_thread(self.peek_meta, *args, **kwargs)

    async def ready_depth_async(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        return await asyncio.to_thread(self.ready_depth, *args, **kwargs)

    async def capabilities_async(self) -> Capabilities:
        return await asyncio.to_thread(self.capabilities)

    async def ping_async(self) -> bool:
        return await asyncio.to_thread(self.ping)

    # ---- awaitable twins of the contract verbs (arguments passed on as given) -------
    async def register_partition_async(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.to_thread(self.register_partition, *args, **kwargs)

    async def claim_meta_async(self, *args: Any, **kwargs: Any) -> KVBatchMeta:
        """``claim_meta``, awaitable; an empty meta: a non-blocking claim with nothing due."""
        return await asyncio.to_thread(self.claim_meta, *args, **kwargs)

    async def get_data_async(self, *args: Any, **kwargs: Any) -> TensorDict:
        return await asyncio.to_thread(self.get_data, *args, **kwargs)

    async def check_consumption_status_async(self, *args: Any, **kwargs: Any) -> bool:
        return await asyncio.to_thread(self.check_consumption_status, *args, **kwargs)

    async def put_samples_async(self, *args: Any, **kwargs: Any) -> KVBatchMeta:
        return await asyncio.to_thread(self.put_samples, *args, **kwargs)

    async def get_samples_async(self, *args: Any, **kwargs: Any) -> TensorDict:
        return await asyncio.to_thread(self.get_samples, *args, **kwargs)

    # Ours return a ClearResult (what was freed); the contract's clear_samples says None.
    async def clear_samples_async(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.clear_samples, *args, **kwargs)


def service_verbs(cls: type) -> list[str]:
    """The public verbs of ``DataPlaneService`` that ``cls`` has (its capabilities' list)."""
    names = {n for n in dir(DataPlaneService) if not n.startswith("_")}
    return sorted(n for n in names if callable(getattr(cls, n, None)))
