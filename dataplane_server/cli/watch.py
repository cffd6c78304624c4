"""``dataplane watch``: one line per stats snapshot, as rates per second.

The table fits an 80-column terminal. Rates come from consecutive snapshots
(the first line has none yet); ``--json`` prints each raw snapshot, running
totals included, one object per line. A stream that ends before ``--count``
snapshots (the service stopped, the connection dropped) exits 3, so a script
or a supervisor can tell "done" from "lost".
"""

from __future__ import annotations

import time

import grpc

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.argtypes import non_negative_int, positive_seconds
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.exits import EXIT_UNREACHABLE, CliError
from dataplane_server.cli.render import emit_json, human_bytes, say

# (header, width): 80 columns with the two-space gaps. PUTQ: puts waiting for admission
# in the writer processes (rejected ones count in ERR/s, as Overloaded); WAIT: blocked claims.
COLUMNS = (
    ("TIME", 8),
    ("SAMPLES", 8),
    ("STORED", 9),
    ("PUT/s", 9),
    ("GET/s", 9),
    ("REQ/s", 6),
    ("PUTQ", 5),
    ("WAIT", 5),
    ("ERR/s", 5),
)
_COUNTERS = ("put_bytes_total", "get_bytes_total", "put_requests_total", "get_requests_total")


def register(sub, endpoint_options) -> None:
    p = sub.add_parser(
        "watch", parents=[endpoint_options], help="stream stats: sizes, rates per second"
    )
    p.add_argument(
        "--interval", type=positive_seconds, default=1.0, help="seconds between snapshots"
    )
    p.add_argument(
        "--count", type=non_negative_int, default=0, help="stop after N snapshots (0 = never)"
    )
    p.set_defaults(endpoint_cmd=run)


def _line(values: list[str]) -> str:
    first, *rest = zip(values, COLUMNS, strict=True)
    cells = [first[0].ljust(first[1][1])] + [v.rjust(w) for v, (_, w) in rest]
    return "  ".join(cells)


def _errors(snap: dict) -> int:
    """Typed errors of the service, and puts the writers refused with Overloaded."""
    return sum(snap["errors"].values()) + snap.get("puts_rejected_total", 0)


def _count_rate(per_s: float) -> str:
    return f"{per_s:.1f}" if per_s < 100 else f"{per_s:.0f}"


def row(snap: dict, prev: dict | None) -> str:
    """One table line; rates against ``prev`` (none for the first, or after a counter reset)."""
    put_rate = get_rate = request_rate = error_rate = "-"
    elapsed = snap["timestamp"] - prev["timestamp"] if prev else 0.0
    if prev and elapsed > 0:
        deltas = [snap[k] - prev[k] for k in _COUNTERS] + [_errors(snap) - _errors(prev)]
        if min(deltas) >= 0:  # a restarted service starts its counters again at 0
            put_b, get_b, puts, gets, errors = (d / elapsed for d in deltas)
            put_rate, get_rate = human_bytes(put_b), human_bytes(get_b)
            request_rate, error_rate = _count_rate(puts + gets), _count_rate(errors)
    clock = time.strftime("%H:%M:%S", time.localtime(snap["timestamp"]))
    return _line(
        [
            clock,
            str(snap["num_samples"]),
            human_bytes(snap["bytes"]),
            put_rate,
            get_rate,
            request_rate,
            str(snap.get("puts_waiting", 0)),
            str(snap["claims_waiting"]),
            error_rate,
        ]
    )


def run(ep, args) -> None:
    request = admin_pb2.WatchStatsRequest(interval_s=args.interval, count=args.count)
    if not args.json:
        say(_line([h for h, _ in COLUMNS]))
    stream = ep.stream("WatchStats", request)
    received, prev = 0, None
    try:
        for message in stream:
            snap = to_builtin(message)
            received += 1
            if args.json:
                emit_json(snap)
            else:
                say(row(snap, prev))
            prev = snap
    except KeyboardInterrupt:
        stream.cancel()
        return
    except grpc.RpcError as exc:
        if received == 0:
            raise  # never connected: the usual unreachable / auth errors
        raise CliError(
            f"the watch stream from {ep.address} dropped after {received} snapshots: "
            f"{exc.code().name}: {exc.details() or ''}",
            EXIT_UNREACHABLE,
        ) from None
    if not args.count or received < args.count:
        raise CliError(
            f"the admin endpoint at {ep.address} ended the watch stream after {received} snapshots",
            EXIT_UNREACHABLE,
        )
