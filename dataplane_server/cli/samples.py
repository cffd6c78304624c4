"""``dataplane samples P``: a partition's samples, paged, optionally filtered by status."""

from __future__ import annotations

import json

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.argtypes import positive_int
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.render import emit_json, joined, say, table

STATUSES = ("ready", "pending", "consumed", "lost")


def register(sub, endpoint_options) -> None:
    p = sub.add_parser(
        "samples", parents=[endpoint_options], help="list a partition's samples, paged"
    )
    p.add_argument("partition")
    p.add_argument("--status", choices=STATUSES)
    p.add_argument(
        "--page-size", type=positive_int, default=100, help="rows per page (at most 1000)"
    )
    p.add_argument("--page-token", help="next page token printed by the previous page")
    p.set_defaults(endpoint_cmd=run)


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
            joined(s["fields"], 40),
            s["sequence_length"],
            s["unit"],
            joined(s["consumed_by"], 30),
            s["redeliveries"],
            "LOST" if s["lost"] else "-",
            json.dumps(s["tags"], separators=(",", ":")) if s["tags"] else "-",
        ]
        for s in page["samples"]
    ]
    headers = ["SAMPLE_ID", "FIELDS", "SEQ_LEN", "UNIT", "CONSUMED_BY", "REDELIV", "LOST", "TAGS"]
    say(table(headers, rows))
    say(f"\n{len(page['samples'])} shown, {page['total']} in all")
    if page["next_page_token"]:
        say(f"next page: --page-token {page['next_page_token']}")
