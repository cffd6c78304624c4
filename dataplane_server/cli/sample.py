"""``dataplane sample P ID``: one sample's status and a preview of its values."""

from __future__ import annotations

import json

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.argtypes import positive_int
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.render import emit_json, joined, say, table_of


def register(sub, endpoint_options) -> None:
    p = sub.add_parser(
        "sample", parents=[endpoint_options], help="one sample's status and a preview of its values"
    )
    p.add_argument("partition")
    p.add_argument("sample_id")
    p.add_argument("--fields", nargs="+", help="fields to preview (default: all produced)")
    p.add_argument(
        "--max-elems", type=positive_int, default=8, help="values shown per field (at most 256)"
    )
    p.set_defaults(endpoint_cmd=run)


def run(ep, args) -> None:
    request = admin_pb2.GetSampleRequest(
        partition_id=args.partition,
        sample_id=args.sample_id,
        fields=args.fields or [],
        max_elems=args.max_elems,
    )
    got = to_builtin(ep.call("GetSample", request))
    if args.json:
        return emit_json(got)
    s = got["sample"]
    say(f"sample       {s['sample_id']} (partition {got['partition_id']})")
    held = ", ".join(f"{t}: lease {n}" for t, n in sorted(s["leased_by"].items()))
    say(f"status       {s['status']}" + (f" ({held})" if held else ""))
    say(f"unit         {s['unit']}" + ("  LOST" if s["lost"] else ""))
    say(f"seq length   {s['sequence_length']}")
    say(f"consumed by  {joined(s['consumed_by'])}")
    say(f"redelivered  {s['redeliveries']}")
    say(f"tags         {json.dumps(s['tags']) if s['tags'] else '-'}")
    if got["previews"]:
        say()
        shown = [
            {
                **p,
                "shape": str(p["shape"]),
                "values": joined(p["values"] or [], 70) + (" ..." if p["truncated"] else ""),
            }
            for p in got["previews"]
        ]
        columns = {"FIELD": "name", "DTYPE": "dtype", "LAYOUT": "layout"}
        say(table_of({**columns, "SHAPE": "shape", "VALUES": "values"}, shown))
