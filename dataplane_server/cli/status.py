"""``dataplane status``: service, units, totals."""

from __future__ import annotations

import grpc

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.render import (
    emit_json,
    human_bytes,
    human_duration,
    human_time,
    say,
    table,
)


def register(sub, endpoint_options) -> None:
    p = sub.add_parser(
        "status", parents=[endpoint_options], help="service info: version, uptime, units, totals"
    )
    p.set_defaults(endpoint_cmd=run)


def _stored_bytes(ep) -> int | None:
    """What `partitions` and `watch` show: the samples' own bytes ("allocated", from
    GetServiceInfo, is the units' memory set aside for them in whole chunks, which
    capacity limits). Partitions are a read the admin token guards; status is not:
    None when the token is missing."""
    try:
        parts = to_builtin(ep.call("ListPartitions", admin_pb2.ListPartitionsRequest()))
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
            raise
        return None
    return sum(p["bytes"] for p in parts.get("partitions", []))


def run(ep, args) -> None:
    info = to_builtin(ep.call("GetServiceInfo", admin_pb2.GetServiceInfoRequest()))
    stored_bytes = _stored_bytes(ep)
    if args.json:
        # Both figures by name (the message's own "bytes" is the allocated one).
        return emit_json({**info, "stored_bytes": stored_bytes, "allocated_bytes": info["bytes"]})
    stored = "? (needs the token)" if stored_bytes is None else human_bytes(stored_bytes)
    say(f"service    {info['name']} (namespace {info['namespace']}), version {info['version']}")
    say(
        f"uptime     {human_duration(info['uptime_s'])} (since {human_time(info['started_at'])})"
        f", draining: {'yes' if info['draining'] else 'no'}"
    )
    durability = info.get("durability") or "memory"
    kept = f", state in {info['state_dir']}" if info.get("state_dir") else ""
    say(f"durability {durability}{kept}")
    say(
        f"holds      {info['num_partitions']} partitions, {info['num_samples']} samples: "
        f"{stored} stored, {human_bytes(info['bytes'])} allocated of "
        f"{human_bytes(info['capacity_bytes'])} capacity"
    )
    say(f"checkpoint {_last_checkpoint(info.get('last_checkpoint'))}")
    say()
    rows = [
        [
            u["index"],
            u["node_ip"] or "-",
            (u["node_id"] or "-")[:12],
            "yes" if u["alive"] else "NO",
            u["samples"],
            human_bytes(u["bytes"]),
            human_bytes(u["capacity_bytes"]),
        ]
        for u in info["units"]
    ]
    say(table(["UNIT", "NODE_IP", "NODE_ID", "ALIVE", "SAMPLES", "ALLOCATED", "CAPACITY"], rows))
    paths = [(u["index"], p) for u in info["units"] for p in u.get("payload_paths") or []]
    if paths:
        say()
        say("cross-node readers reach the units' bytes by (their probes' choices):")
        for index, p in paths:
            say(f"  unit {index}: {p['path']} x{p['readers']}  ({p['detail'] or '-'})")


def _last_checkpoint(last: dict | None) -> str:
    """Where the last checkpoint is, its cut's position and time, and what it cost."""
    if not last:
        return "none saved since the controller started"
    journal = ""
    if int(last.get("journal_generation", -1)) >= 0:
        journal = f", journal {last['journal_generation']}:{last.get('journal_records', 0)}"
    kind = f"incremental to {last['parent']}" if last.get("parent") else "full"
    return (
        f"{last['directory']} at position {last.get('position', 0)}{journal}, "
        f"{human_time(last['taken_at'])}, {kind}: {human_bytes(int(last.get('bytes_written', 0)))}"
        f" written, {human_bytes(int(last.get('bytes_linked', 0)))} linked"
    )
