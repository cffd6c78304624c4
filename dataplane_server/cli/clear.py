"""``dataplane clear P [ID ...]``: drop samples; with no ids, the whole partition.

Clearing a whole partition deletes it (NeMo-RL's ``clear_samples(None, p)``),
so the next registration of the same id starts clean; ``dataplane delete``
says that outright.
"""

from __future__ import annotations

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.endpoint import partition_command
from dataplane_server.cli.render import emit_json, say


def register(sub, endpoint_options) -> None:
    help = "drop samples of a partition; no ids = all of it, deleting it (needs the token)"
    p = partition_command(sub, endpoint_options, "clear", help, run)
    p.add_argument("sample_ids", nargs="*", metavar="ID", help="samples to drop (default: all)")


def run(ep, args) -> None:
    request = admin_pb2.ClearPartitionRequest(
        partition_id=args.partition, sample_ids=args.sample_ids
    )
    got = to_builtin(ep.call("ClearPartition", request))
    if args.json:
        return emit_json(got)
    say(f"cleared partition {got['partition_id']} ({got['cleared_samples']} samples)")
