"""A Ray worker group: PP x DP x CP x TP actors joined to one torch.distributed world.

The driver creates one actor per rank (an actor class built from a worker
class that subclasses :class:`DistributedWorker`), picks a free port, and has
every actor join the same process group (gloo on CPU, NCCL when the workers
see CUDA). Each worker then creates, in the same order on every rank, the
subgroups it needs:

- replica group: the TP x CP x PP siblings of one DP rank (they hold the same
  data; the leader fetches and broadcasts inside it);
- TP group: ranks that differ only along tensor_parallel (vocab-parallel head);
- DP group: ranks that differ only along data_parallel (gradient all-reduce).

A group with a single member is ``None``: nothing to communicate.

Dispatch mirrors NeMo-RL's worker group: ``run_all_workers_single_data`` calls
a method everywhere with the same arguments; ``run_all_workers_sharded_data``
gives each worker the slice of ``data`` at its coordinates on the sharded axes
(the same object to every replica) and remembers which workers' results to
keep (axis-zero of the ``output_is_replicated`` axes).

A worker that dies during a call breaks the torch.distributed world of every
other worker (their next collective with it fails or waits for the collective
timeout). So the first death seen while gathering results shuts the whole group
down and raises :class:`~policy_workers.errors.PolicyWorkerLost` at once, and
every later call raises it too: the caller builds a new group (and loads the
last checkpoint) instead of waiting on survivors stuck in a collective.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError, RayTaskError

from dataplane_client.wire.errors import DataPlaneError
from policy_workers.errors import PolicyWorkerLost
from policy_workers.sharding import (
    DATA_PARALLEL,
    REPLICA_AXES,
    TENSOR_PARALLEL,
    NamedSharding,
)


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class DistributedWorker:
    """Base of actor bodies in a :class:`RayWorkerGroup`: rank, coordinates, process groups."""

    def __init__(self, *, rank: int, sharding: NamedSharding, torch_threads: int | None = 1):
        self.rank = int(rank)
        self.sharding = sharding
        self.world_size = sharding.size
        self.coords = sharding.get_worker_coords(self.rank)
        if torch_threads:
            torch.set_num_threads(int(torch_threads))
        self.replica_group: Any = None
        self.replica_ranks: list[int] = [self.rank]
        self.tp_group: Any = None
        self.dp_group: Any = None

    # ---- collectives setup (called by the group on every worker concurrently) ----
    def init_distributed(
        self, master_addr: str, master_port: int, backend: str, timeout_s: float = 300.0
    ) -> None:
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        if master_addr in ("127.0.0.1", "localhost"):
            # gloo otherwise binds the interface of the host name, which may not be loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray exposes one GPU per actor as device 0
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # new_group must be called by every rank for every group, in the same order.
        self.replica_group, self.replica_ranks = self._new_groups(REPLICA_AXES)
        self.tp_group, _ = self._new_groups([TENSOR_PARALLEL])
        self.dp_group, _ = self._new_groups([DATA_PARALLEL])

    def _new_groups(self, axes: Sequence[str]) -> tuple[Any, list[int]]:
        mine, my_ranks = None, [self.rank]
        for ranks in self.sharding.groups_along(axes):
            if len(ranks) < 2:
                continue  # a singleton group has nothing to communicate
            group = dist.new_group(ranks)
            if self.rank in ranks:
                mine, my_ranks = group, ranks
        return mine, my_ranks

    def get_rank(self) -> int:
        return self.rank

    def get_coords(self) -> dict[str, int]:
        return dict(self.coords)

    def shutdown(self) -> bool:
        if dist.is_initialized():
            dist.destroy_process_group()
        return True


@dataclass
class WorkerFutures:
    """Futures of one dispatch plus which of them carry a result worth keeping."""

    refs: list[ray.ObjectRef]
    worker_ranks: list[int]
    keep: list[bool]
    method: str = ""


# After one worker's call failed, how long to keep waiting for the others before
# raising that failure: long enough to see whether a worker died (a peer's death
# makes the survivors' collectives fail first), short next to a collective timeout.
DEATH_GRACE_S = 10.0


class RayWorkerGroup:
    """``sharding.size`` Ray actors of ``worker_cls``, one torch.distributed world."""

    def __init__(
        self,
        worker_cls: type,
        sharding: NamedSharding,
        *,
        worker_kwargs: dict[str, Any] | None = None,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float | None = None,
        backend: str | None = None,
        master_addr: str = "127.0.0.1",
        collective_timeout_s: float = 300.0,
        name_prefix: str | None = None,
    ):
        if not issubclass(worker_cls, DistributedWorker):
            raise TypeError(f"{worker_cls.__name__} must subclass DistributedWorker")
        if num_gpus_per_worker is None:
            num_gpus_per_worker = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
        if backend is None:
            backend = "nccl" if num_gpus_per_worker > 0 else "gloo"
        self.sharding = sharding
        self.backend = backend
        self.lost: str | None = None  # why the group is unusable, once a worker died
        actor_cls = ray.remote(worker_cls)
        # Ray actor handles, called as ``w.method.remote(...)``: Ray's stubs type neither
        # that nor ``.remote()``'s result precisely, so the handles are kept untyped.
        self.workers: list[Any] = []
        for rank in range(sharding.size):
            options: dict[str, Any] = {
                "num_cpus": num_cpus_per_worker,
                "num_gpus": num_gpus_per_worker,
            }
            if name_prefix:
                options["name"] = f"{name_prefix}-{rank}"
            self.workers.append(
                actor_cls.options(**options).remote(
                    rank=rank, sharding=sharding, **(worker_kwargs or {})
                )
            )
        port = find_free_port(master_addr)
        try:
            ray.get(
                [
                    w.init_distributed.remote(master_addr, port, backend, collective_timeout_s)
                    for w in self.workers
                ]
            )
        except Exception:
            self.shutdown()
            raise

    @property
    def world_size(self) -> int:
        return len(self.workers)

    # ---- dispatch ----------------------------------------------------------------
    def run_all_workers_single_data(
        self, method: str, *args: Any, **kwargs: Any
    ) -> list[ray.ObjectRef]:
        """Call ``method(*args, **kwargs)`` on every worker; returns one future per worker (rank order)."""
        return [getattr(w, method).remote(*args, **kwargs) for w in self.workers]

    def run_all_workers_sharded_data(
        self,
        method: str,
        data: Sequence[Any],
        *,
        in_sharded_axes: Sequence[str] = (DATA_PARALLEL,),
        replicate_on_axes: Sequence[str] = (),
        output_is_replicated: Sequence[str] = (),
        common_kwargs: dict[str, Any] | None = None,
        data_arg: str = "data",
        make_dummy_calls_to_free_axes: bool = False,
    ) -> WorkerFutures:
        """Give each worker the slice of ``data`` at its coordinates on ``in_sharded_axes``.

        ``data`` is nested one list level per sharded axis (in the given order).
        Workers off axis-zero of an axis that is neither sharded nor replicated get
        no call (or a call with ``data=None`` when ``make_dummy_calls_to_free_axes``).
        Each slice is put in the object store once and shared by its replicas.
        """
        names = self.sharding.names
        for axis in (*in_sharded_axes, *replicate_on_axes, *output_is_replicated):
            if axis not in names:
                raise ValueError(f"unknown axis {axis!r}; axes are {names}")
        free_axes = [a for a in names if a not in in_sharded_axes and a not in replicate_on_axes]
        common_kwargs = dict(common_kwargs or {})
        refs, ranks, keep = [], [], []
        shared: dict[tuple[int, ...], Any] = {}
        for rank, worker in enumerate(self.workers):
            coords = self.sharding.get_worker_coords(rank)
            receives = NamedSharding.is_axis_zero(coords, free_axes)
            if receives:
                key = tuple(coords[a] for a in in_sharded_axes)
                if key not in shared:
                    piece = data
                    for axis in in_sharded_axes:
                        piece = piece[coords[axis]]
                    # one object-store copy per slice, however many replicas read it
                    shared[key] = ray.put(piece)
                payload = shared[key]
            elif make_dummy_calls_to_free_axes:
                payload = None
            else:
                continue
            refs.append(getattr(worker, method).remote(**{data_arg: payload}, **common_kwargs))
            ranks.append(rank)
            keep.append(receives and NamedSharding.is_axis_zero(coords, output_is_replicated))
        return WorkerFutures(refs, ranks, keep, method)

    def call_all_workers(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every worker; every result, rank order."""
        refs = self.run_all_workers_single_data(method, *args, **kwargs)
        n = len(refs)
        return self.get_all_worker_results(WorkerFutures(refs, list(range(n)), [True] * n, method))

    def get_all_worker_results(self, futures: WorkerFutures) -> list[Any]:
        """Every future's result; those of the workers marked to keep (rank order).

        A dead worker: :class:`PolicyWorkerLost` (the group is shut down). A
        typed data-plane error raised in a worker: that error, as its own class.
        """
        self._check_usable()
        pending = dict(zip(futures.refs, futures.worker_ranks))
        results: dict[Any, Any] = {}
        failure: RayTaskError | None = None
        give_up_at = None
        while pending:
            timeout = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break  # the failure below was not a worker's death
            ref = ready[0]
            rank = pending.pop(ref)
            try:
                results[ref] = ray.get(ref)
            except RayActorError as e:
                self._lose(rank, futures.method, e)
            except RayTaskError as e:
                if failure is None:
                    failure, give_up_at = e, time.monotonic() + DEATH_GRACE_S
        if failure is not None:
            cause = getattr(failure, "cause", None)
            raise cause if isinstance(cause, DataPlaneError) else failure
        return [results[r] for r, k in zip(futures.refs, futures.keep) if k]

    def _check_usable(self) -> None:
        if self.lost is not None:
            raise PolicyWorkerLost(self.lost)

    def _lose(self, rank: int, method: str, error: RayActorError) -> None:
        coords = self.sharding.get_worker_coords(rank)
        self.lost = (
            f"policy worker rank {rank} {dict(coords)} died during {method or 'a call'}; "
            "the worker group was shut down (build a new policy and load the last checkpoint)"
        )
        # Survivors may sit in a collective with the dead rank: end them, do not wait.
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already dead or gone: nothing left to end
                pass
        self.workers = []
        raise PolicyWorkerLost(self.lost) from error

    def shutdown(self, cleanup_method: str | None = "shutdown", timeout_s: float = 30.0) -> bool:
        """Run ``cleanup_method`` on every worker (best effort), then kill the actors."""
        ok = True
        if cleanup_method:
            try:
                ray.get(
                    [getattr(w, cleanup_method).remote() for w in self.workers], timeout=timeout_s
                )
            except Exception:  # noqa: BLE001 - best-effort cleanup; reported via ok
                ok = False
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - best-effort cleanup; reported via ok
                ok = False
        self.workers = []
        return ok
