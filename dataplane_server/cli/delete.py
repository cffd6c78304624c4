"""``dataplane delete P``: delete a partition, its samples, bytes and declaration."""

from __future__ import annotations

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.endpoint import partition_command
from dataplane_server.cli.render import emit_json, human_bytes, say


def register(sub, endpoint_options) -> None:
    help = "delete a partition: samples, bytes and declaration (needs the token)"
    partition_command(sub, endpoint_options, "delete", help, run)


def run(ep, args) -> None:
    request = admin_pb2.DeletePartitionRequest(partition_id=args.partition)
    got = to_builtin(ep.call("DeletePartition", request))
    if args.json:
        return emit_json(got)
    say(
        f"deleted partition {got['partition_id']} "
        f"({got['deleted_samples']} samples, {human_bytes(got['bytes_freed'])} freed)"
    )
