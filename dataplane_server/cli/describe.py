"""``dataplane describe P``: fields, consumption, claims and bytes of one partition."""

from __future__ import annotations

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.endpoint import partition_command
from dataplane_server.cli.render import emit_json, human_bytes, human_time, say, table, table_of


def register(sub, endpoint_options) -> None:
    help = "fields, consumption, claims, bytes of a partition"
    partition_command(sub, endpoint_options, "describe", help, run)


def _lease(c: dict) -> str:
    return f"{c['lease_s']:g}s" if c["lease_s"] is not None else "-"


def _kept(d: dict) -> str:
    """The service's durability level and how much of the partition its last checkpoint holds."""
    level = d.get("durability") or "memory"
    if d.get("checkpointed_samples") is None:
        return f"{level}; no checkpoint saved yet"
    when = human_time(d["last_checkpoint_at"])
    return f"{level}; {d['checkpointed_samples']} samples in the last checkpoint ({when})"


def run(ep, args) -> None:
    request = admin_pb2.DescribePartitionRequest(partition_id=args.partition)
    d = to_builtin(ep.call("DescribePartition", request))
    if args.json:
        return emit_json(d)
    expected = d["expected_samples"]
    say(f"partition       {d['partition_id']}")
    say(f"samples         {d['num_samples']}" + (f" of {expected} expected" if expected else ""))
    say(f"group size      {d['group_size'] if d['group_size'] is not None else '-'}")
    say(f"created         {human_time(d['created_at'])}")
    say(f"pending claims  {d['pending_claims']}")
    say(f"durability      {_kept(d)}")
    say()
    fields = [
        [f["name"], f["dtype"] or "-", f["layout"], str(f["trailing_shape"]), f["produced"]]
        for f in d["fields"]
    ]
    say(table(["FIELD", "DTYPE", "LAYOUT", "TRAILING_SHAPE", "PRODUCED"], fields))
    if d["consumption"]:
        say()
        tasks = [
            {**c, "done": "yes" if c["done"] else "no", "lease": _lease(c)}
            for c in d["consumption"]
        ]
        columns = {
            "TASK": "task",
            "CONSUMED": "consumed",
            "OF": "total",
            "DONE": "done",
            "LEASE": "lease",
            "LEASED": "leased",
            "REDELIVERED": "redeliveries",
        }
        say(table_of(columns, tasks))
    if d["bytes_per_unit"]:
        say()
        rows = [[b["unit"], human_bytes(b["bytes"])] for b in d["bytes_per_unit"]]
        say(table(["UNIT", "STORED"], rows))
    if d.get("staleness"):
        say()
        _staleness(d["staleness"])


def _staleness(st: dict) -> None:
    """A versioned partition's async-RL state: version, window, drops, admission."""
    bounds = ", ".join(f"{t}: {n}" for t, n in sorted(st["max_staleness"].items())) or "-"
    say(f"policy version  {st['version']} (tag {st['version_tag']})")
    say(f"max staleness   {bounds}; stale samples {st['stale_samples']}")
    dropped = ", ".join(f"{t}: {n}" for t, n in sorted(st["dropped_stale"].items())) or "0"
    say(f"dropped stale   {dropped}; evicted {st['evicted']}")
    filtered = ", ".join(f"{t}: {n}" for t, n in sorted(st.get("filtered", {}).items())) or "0"
    say(f"filtered out    {filtered} (refused by filtered claims, not owed)")
    limit = st.get("admission_limit")
    say(
        f"admission       {st['granted_in_flight']} granted in flight ({st['grants']} grants), "
        f"{st['untrained']} untrained, bound {limit if limit is not None else '-'}, "
        f"{st['admission_waits']} waits"
    )
    say(f"partial         {st.get('partial_in_progress', 0)} rollouts in progress (not claimable)")
    by_version = sorted((int(v), n) for v, n in st["ready_by_version"].items())
    if by_version:
        say(table(["VERSION", "LIVE_SAMPLES"], [[v, n] for v, n in by_version]))
