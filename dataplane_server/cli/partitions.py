"""``dataplane partitions``: one row per partition."""

from __future__ import annotations

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.render import emit_json, human_bytes, human_time, joined, say, table


def register(sub, endpoint_options) -> None:
    p = sub.add_parser("partitions", parents=[endpoint_options], help="list partitions")
    p.set_defaults(endpoint_cmd=run)


def run(ep, args) -> None:
    got = ep.call("ListPartitions", admin_pb2.ListPartitionsRequest())
    parts = to_builtin(got)["partitions"]
    if args.json:
        return emit_json(parts)
    if not parts:
        return say("no partitions")
    rows = [
        [
            p["partition_id"],
            p["num_samples"],
            human_bytes(p["bytes"]),
            joined(p["fields"]),
            joined(p["consumer_tasks"]),
            human_time(p["created_at"]),
        ]
        for p in parts
    ]
    say(table(["PARTITION", "SAMPLES", "STORED", "FIELDS", "CONSUMERS", "CREATED"], rows))
