"""A commit into a Ray-free key space as a client's put makes it: every sample on unit 0,
staged there, no overwrite; the plan checked, then applied."""

from __future__ import annotations

from dataplane_client.wire.messages import CommitRequest
from dataplane_server.core.keyspace import CommitPlan, KeySpace


def commit(
    ks: KeySpace,
    pid: str,
    ids: list[str],
    schemas: dict,
    *,
    write_id: str = "w",
    lengths: list[int] | None = None,
    tags: list[dict] | None = None,
) -> None:
    plan = ks.check_commit(
        CommitRequest(
            partition_id=pid,
            write_id=write_id,
            sample_ids=list(ids),
            units=[0] * len(ids),
            schemas=schemas,
            sequence_lengths=lengths,
            tags=tags,
            overwrite=False,
            staged_units=[0],
        )
    )
    assert isinstance(plan, CommitPlan)
    ks.apply_commit(plan)
