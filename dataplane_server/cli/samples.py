"""``dataplane samples P``: a partition's samples, paged, optionally filtered by status."""

from __future__ import annotations

import json

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.argtypes import positive_int
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.render import emit_json, joined, say, table

STATUSES = ("ready", "pending", "leased", "consumed", "lost")


def register(sub, endpoint_options) -> None:
    p = sub.add_parser(
        "samples", parents=[endpoint_options], help="list a partition's samples, paged"
    )
    p.add_argument("partition")
    p.add_argument(
        "--status",
        choices=STATUSES,
        help="only samples in this state (leased: claimed by a leased task, not acknowledged)",
    )
    p.add_argument(
        "--page-size", type=positive_int, default=100, help="rows per page (at most 1000)"
    )
    p.add_argument("--page-token", help="next page token printed by the previous page")
    p.set_defaults(endpoint_cmd=run)


def holders(leased_by: dict[str, int]) -> str:
    """TASK:LEASE_ID of each claim holding the sample under a lease, or "-"."""
    return joined([f"{task}:{lease}" for task, lease in sorted(leased_by.items())], 40)


def run(ep, args) -> None:
    request = admin_pb2.ListSamplesRequest(
        partition_id=args.partition,
        status=admin_pb2.SampleStatus.Value(
            f"SAMPLE_STATUS_{(args.status or 'unspecified').upper()}"
        ),
        page_size=args.page_size,
        page_token=args.page_token or "",
    )
    page = to_builtin(ep.call("ListSamples", request))
    if args.json:
        return emit_json(page)
    rows = [
        [
            s["sample_id"],
            s["status"],
            joined(s["fields"], 40),
            s["sequence_length"],
            s["unit"],
            joined(s["consumed_by"], 30),
            holders(s["leased_by"]),
            s["redeliveries"],
            json.dumps(s["tags"], separators=(",", ":")) if s["tags"] else "-",
        ]
        for s in page["samples"]
    ]
    headers = [
        "SAMPLE_ID",
        "STATUS",
        "FIELDS",
        "SEQ_LEN",
        "UNIT",
        "CONSUMED_BY",
        "HELD_BY",
        "REDELIV",
        "TAGS",
    ]
    say(table(headers, rows))
    say(f"\n{len(page['samples'])} shown, {page['total']} in all")
    if page["next_page_token"]:
        say(f"next page: --page-token {page['next_page_token']}")
