"""``dataplane``: run the service, and look inside a running one through its admin endpoint.

    dataplane serve --config dataplane.yaml        # until SIGTERM / SIGINT, then drain
    dataplane status      --address HOST:PORT      # service, units, totals
    dataplane partitions  --address HOST:PORT
    dataplane describe P  --address HOST:PORT
    dataplane samples P   --address HOST:PORT [--status ready] [--page-size 50] [--page-token T]
    dataplane sample P ID --address HOST:PORT      # one sample + a preview of its values
    dataplane clear P     --address HOST:PORT --token T
    dataplane watch       --address HOST:PORT [--interval 1] [--count N]

Client commands read ``DATAPLANE_ADMIN_ADDRESS`` / ``DATAPLANE_ADMIN_TOKEN`` when
--address / --token are not given, print tables (``--json`` for scripts: one
JSON document, or one JSON object per line for ``watch``), and exit with
1 on a refused request, 3 when the endpoint cannot be reached, 4 when the
token is missing or wrong. Only grpc and the generated messages are imported
for them: no Ray, no torch, so they start fast.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_UNREACHABLE = 3
EXIT_AUTH = 4

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SERVE_NUM_CPUS = 8  # logical slots for the embedded Ray; actors need them even when idle

# Subcommands that belong to upper layers: imported only when called.
DELEGATED = {
    "demo": ("policy_workers.demo", "run the end-to-end GRPO-style demo"),
    "bench": ("benchmarks.run", "run the benchmarks"),
}


class CliError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code


# ------------------------------------------------------------------ protobuf -> builtins


def _enum_prefix(enum_name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum_name).upper() + "_"


def _plain_number(x: Any) -> Any:
    # Struct / ListValue store every number as a double; show 3 rather than 3.0.
    if isinstance(x, float) and x.is_integer() and abs(x) < 2**53:
        return int(x)
    if isinstance(x, list):
        return [_plain_number(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain_number(v) for k, v in x.items()}
    return x


def to_builtin(message) -> dict[str, Any]:
    """A message as JSON-able builtins: int64 stays a number, enums become lower-case
    names without their prefix ("jagged", "ready"), unset optional fields become None."""
    from google.protobuf import json_format

    out: dict[str, Any] = {}
    for fd in message.DESCRIPTOR.fields:
        value = getattr(message, fd.name)
        if fd.has_presence and fd.message_type is None and not message.HasField(fd.name):
            out[fd.name] = None
        elif fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {
                k: to_builtin(v) if value_fd.message_type is not None else v
                for k, v in value.items()
            }
        elif fd.message_type is not None and fd.message_type.full_name.startswith(
            "google.protobuf."
        ):
            if fd.is_repeated:
                out[fd.name] = [_plain_number(json_format.MessageToDict(v)) for v in value]
            else:
                out[fd.name] = _plain_number(json_format.MessageToDict(value))
        elif fd.message_type is not None:
            out[fd.name] = [to_builtin(v) for v in value] if fd.is_repeated else to_builtin(value)
        elif fd.enum_type is not None:
            prefix = _enum_prefix(fd.enum_type.name)

            def name(n, fd=fd, prefix=prefix):
                return fd.enum_type.values_by_number[n].name.removeprefix(prefix).lower()

            out[fd.name] = [name(v) for v in value] if fd.is_repeated else name(value)
        else:
            out[fd.name] = list(value) if fd.is_repeated else value
    return out


# ------------------------------------------------------------------------- rendering


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def human_time(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s)) if unix_s else "-"


def _joined(items: Sequence[Any], limit: int = 60) -> str:
    text = ",".join(str(x) for x in items) or "-"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [
        bool(rows) and all(isinstance(r[i], int | float) for r in rows) for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in cells])


def _print(text: str = "") -> None:
    print(text, flush=True)


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=False), flush=True)


# ----------------------------------------------------------------------- the endpoint


class AdminEndpoint:
    """A channel + stub to one admin endpoint, with the token and a short deadline."""

    def __init__(self, args: argparse.Namespace):
        import grpc

        from dataplane_server.admin_pb import admin_pb2_grpc

        self.address = args.address or os.environ.get("DATAPLANE_ADMIN_ADDRESS")
        if not self.address:
            raise CliError(
                "no admin address: pass --address HOST:PORT or set DATAPLANE_ADMIN_ADDRESS"
            )
        self.timeout = args.timeout
        token = args.token or os.environ.get("DATAPLANE_ADMIN_TOKEN")
        self.metadata = [("authorization", f"Bearer {token}")] if token else []
        if args.tls_ca:
            try:
                with open(args.tls_ca, "rb") as f:
                    ca = f.read()
            except OSError as exc:
                raise CliError(f"cannot read --tls-ca {args.tls_ca}: {exc.strerror}") from None
            options = []
            if args.tls_server_name:
                options.append(("grpc.ssl_target_name_override", args.tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=ca)
            self.channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(self.address)
        self.stub = admin_pb2_grpc.AdminServiceStub(self.channel)

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, timeout=self.timeout, metadata=self.metadata)

    def stream(self, method: str, request):
        return getattr(self.stub, method)(request, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def _rpc_error(exc, address: str, timeout: float) -> CliError:
    import grpc

    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return CliError(
            f"cannot reach the admin endpoint at {address}: {details}", EXIT_UNREACHABLE
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CliError(
            f"no answer from the admin endpoint at {address} within {timeout:g}s", EXIT_UNREACHABLE
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            f"the admin endpoint at {address} refused the token (missing or wrong): "
            "pass --token or set DATAPLANE_ADMIN_TOKEN",
            EXIT_AUTH,
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return CliError(f"permission denied: {details}", EXIT_AUTH)
    return CliError(f"{code.name}: {details}", EXIT_FAILED)


# -------------------------------------------------------------------------- commands


def cmd_status(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

    info = to_builtin(ep.call("GetServiceInfo", admin_pb2.GetServiceInfoRequest()))
    if args.json:
        return _emit_json(info)
    _print(f"service    {info['name']} (namespace {info['namespace']}), version {info['version']}")
    _print(
        f"uptime     {human_duration(info['uptime_s'])} (since {human_time(info['started_at'])})"
        f", draining: {'yes' if info['draining'] else 'no'}"
    )
    _print(
        f"holds      {info['num_partitions']} partitions, {info['num_samples']} samples, "
        f"{human_bytes(info['bytes'])} of {human_bytes(info['capacity_bytes'])}"
    )
    _print()
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
    _print(table(["UNIT", "NODE_IP", "NODE_ID", "ALIVE", "SAMPLES", "BYTES", "CAPACITY"], rows))


def cmd_partitions(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

    parts = to_builtin(ep.call("ListPartitions", admin_pb2.ListPartitionsRequest()))["partitions"]
    if args.json:
        return _emit_json(parts)
    if not parts:
        return _print("no partitions")
    rows = [
        [
            p["partition_id"],
            p["num_samples"],
            human_bytes(p["bytes"]),
            _joined(p["fields"]),
            _joined(p["consumer_tasks"]),
            human_time(p["created_at"]),
        ]
        for p in parts
    ]
    _print(table(["PARTITION", "SAMPLES", "BYTES", "FIELDS", "CONSUMERS", "CREATED"], rows))


def cmd_describe(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

    request = admin_pb2.DescribePartitionRequest(partition_id=args.partition)
    d = to_builtin(ep.call("DescribePartition", request))
    if args.json:
        return _emit_json(d)
    expected = d["expected_samples"]
    _print(f"partition       {d['partition_id']}")
    _print(f"samples         {d['num_samples']}" + (f" of {expected} expected" if expected else ""))
    _print(f"group size      {d['group_size'] if d['group_size'] is not None else '-'}")
    _print(f"created         {human_time(d['created_at'])}")
    _print(f"pending claims  {d['pending_claims']}")
    _print()
    fields = [
        [f["name"], f["dtype"] or "-", f["layout"], str(f["trailing_shape"]), f["produced"]]
        for f in d["fields"]
    ]
    _print(table(["FIELD", "DTYPE", "LAYOUT", "TRAILING_SHAPE", "PRODUCED"], fields))
    if d["consumption"]:
        _print()
        rows = [[c["task"], c["consumed"]] for c in d["consumption"]]
        _print(table(["TASK", "CONSUMED"], rows))
    if d["bytes_per_unit"]:
        _print()
        rows = [[b["unit"], human_bytes(b["bytes"])] for b in d["bytes_per_unit"]]
        _print(table(["UNIT", "BYTES"], rows))


def cmd_samples(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

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
        return _emit_json(page)
    rows = [
        [
            s["sample_id"],
            _joined(s["fields"], 40),
            s["sequence_length"],
            s["unit"],
            _joined(s["consumed_by"], 30),
            "LOST" if s["lost"] else "-",
            json.dumps(s["tags"], separators=(",", ":")) if s["tags"] else "-",
        ]
        for s in page["samples"]
    ]
    _print(table(["SAMPLE_ID", "FIELDS", "SEQ_LEN", "UNIT", "CONSUMED_BY", "LOST", "TAGS"], rows))
    _print(f"\n{len(page['samples'])} shown, {page['total']} in all")
    if page["next_page_token"]:
        _print(f"next page: --page-token {page['next_page_token']}")


def cmd_sample(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

    request = admin_pb2.GetSampleRequest(
        partition_id=args.partition,
        sample_id=args.sample_id,
        fields=args.fields or [],
        max_elems=args.max_elems,
    )
    got = to_builtin(ep.call("GetSample", request))
    if args.json:
        return _emit_json(got)
    s = got["sample"]
    _print(f"sample       {s['sample_id']} (partition {got['partition_id']})")
    _print(f"unit         {s['unit']}" + ("  LOST" if s["lost"] else ""))
    _print(f"seq length   {s['sequence_length']}")
    _print(f"consumed by  {_joined(s['consumed_by'])}")
    _print(f"tags         {json.dumps(s['tags']) if s['tags'] else '-'}")
    if got["previews"]:
        _print()
        rows = [
            [
                p["name"],
                p["dtype"],
                p["layout"],
                str(p["shape"]),
                _joined(p["values"] or [], 70) + (" ..." if p["truncated"] else ""),
            ]
            for p in got["previews"]
        ]
        _print(table(["FIELD", "DTYPE", "LAYOUT", "SHAPE", "VALUES"], rows))


def cmd_clear(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

    request = admin_pb2.ClearPartitionRequest(partition_id=args.partition)
    got = to_builtin(ep.call("ClearPartition", request))
    if args.json:
        return _emit_json(got)
    _print(f"cleared partition {got['partition_id']} ({got['cleared_samples']} samples)")


def cmd_watch(ep: AdminEndpoint, args) -> None:
    from dataplane_server.admin_pb import admin_pb2

    request = admin_pb2.WatchStatsRequest(interval_s=args.interval, count=args.count)
    headers = ["TIME", "SAMPLES", "BYTES", "PUT", "GET", "PUTS", "GETS", "CLAIMS_WAITING", "ERRORS"]
    widths = [8, 9, 11, 11, 11, 8, 8, 14, 6]
    if not args.json:
        _print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    stream = ep.stream("WatchStats", request)
    try:
        for snap in stream:
            s = to_builtin(snap)
            if args.json:
                _emit_json(s)
                continue
            row = [
                time.strftime("%H:%M:%S", time.localtime(s["timestamp"])),
                str(s["num_samples"]),
                human_bytes(s["bytes"]),
                human_bytes(s["put_bytes_total"]),
                human_bytes(s["get_bytes_total"]),
                str(s["put_requests_total"]),
                str(s["get_requests_total"]),
                str(s["claims_waiting"]),
                str(sum(s["errors"].values())),
            ]
            _print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    except KeyboardInterrupt:
        stream.cancel()


def cmd_serve(args) -> int:
    import signal
    import threading

    from dataplane_client.config import DataPlaneConfig

    config = DataPlaneConfig.from_file(args.config) if args.config else DataPlaneConfig()
    address = args.address or os.environ.get("RAY_ADDRESS")
    import ray

    if address:  # an existing cluster (inside `ray job submit`, RAY_ADDRESS is set)
        ray.init(address=address, namespace=config.namespace, log_to_driver=args.ray_logs)
    else:  # embedded: a local Ray bound to loopback
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray.init(
            # "local": always a new instance; never attach to whatever `ray start` ran last here.
            address="local",
            num_cpus=args.num_cpus,
            include_dashboard=False,
            namespace=config.namespace,
            log_to_driver=args.ray_logs,
            _node_ip_address="127.0.0.1",
        )
    from dataplane_server.service import start

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        # A second signal while draining falls back to the default: stop at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    handle = start(config)
    _print(f"dataplane: serving {config.name!r} in namespace {config.namespace!r}")
    _print(f"admin_address={handle.admin_address}")
    _print(f"metrics_address={handle.metrics_address}")
    while not stop.wait(0.5):
        pass
    _print("dataplane: signal received, draining")
    try:
        handle.drain()
    finally:
        handle.shutdown()
    _print("dataplane: stopped")
    return EXIT_OK


# ----------------------------------------------------------------------------- parser


def _client_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("admin endpoint")
    g.add_argument(
        "--address", help="HOST:PORT of the admin endpoint (env DATAPLANE_ADMIN_ADDRESS)"
    )
    g.add_argument("--token", help="bearer token (env DATAPLANE_ADMIN_TOKEN)")
    g.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle: connect with TLS")
    g.add_argument("--tls-server-name", help="name to verify in the server certificate")
    g.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request (default 5)"
    )
    g.add_argument("--json", action="store_true", help="print JSON for scripts")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataplane",
        description="Run the data-plane service, or inspect a running one.",
        epilog="exit codes: 0 ok, 1 request refused, 2 usage, 3 endpoint unreachable, 4 auth",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _client_options()

    serve = sub.add_parser("serve", help="run the service until SIGTERM/SIGINT, then drain")
    serve.add_argument("--config", metavar="FILE", help="YAML or JSON DataPlaneConfig")
    serve.add_argument(
        "--address",
        "--ray-address",
        dest="address",
        help="Ray cluster address (default: $RAY_ADDRESS, else an embedded local Ray on loopback)",
    )
    serve.add_argument(
        "--num-cpus",
        type=int,
        default=DEFAULT_SERVE_NUM_CPUS,
        help="logical CPUs of the embedded Ray (default %(default)s)",
    )
    serve.add_argument("--ray-logs", action="store_true", help="forward actor logs to stdout")
    serve.set_defaults(run=cmd_serve)

    def client_cmd(name: str, fn: Callable, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_text)
        p.set_defaults(endpoint_cmd=fn)
        return p

    client_cmd("status", cmd_status, "service info: version, uptime, units, totals")
    client_cmd("partitions", cmd_partitions, "list partitions")
    client_cmd(
        "describe", cmd_describe, "fields, consumption, claims, bytes of a partition"
    ).add_argument("partition")
    p = client_cmd("samples", cmd_samples, "list a partition's samples, paged")
    p.add_argument("partition")
    p.add_argument("--status", choices=["ready", "pending", "consumed", "lost"])
    p.add_argument("--page-size", type=int, default=100)
    p.add_argument("--page-token", help="next page token printed by the previous page")
    p = client_cmd("sample", cmd_sample, "one sample's status and a preview of its values")
    p.add_argument("partition")
    p.add_argument("sample_id")
    p.add_argument("--fields", nargs="+", help="fields to preview (default: all produced)")
    p.add_argument("--max-elems", type=int, default=8, help="values shown per field")
    client_cmd(
        "clear", cmd_clear, "drop every sample of a partition (needs the token)"
    ).add_argument("partition")
    p = client_cmd("watch", cmd_watch, "stream stats snapshots")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between snapshots")
    p.add_argument("--count", type=int, default=0, help="stop after N snapshots (0 = never)")

    for name, (_module, help_text) in DELEGATED.items():
        sub.add_parser(
            name, help=f"{help_text} (python -m dataplane_server {name} --help)", add_help=False
        )
    return parser


def _delegate(name: str, argv: list[str]) -> int:
    import importlib

    module = importlib.import_module(DELEGATED[name][0])
    rc = module.main(argv)
    return int(rc or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:  # their own parsers own every option after the name
        return _delegate(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if hasattr(args, "run"):
        return args.run(args)
    endpoint = None
    try:
        endpoint = AdminEndpoint(args)
        args.endpoint_cmd(endpoint, args)
        return EXIT_OK
    except CliError as exc:
        print(f"dataplane: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:
        import grpc

        if not isinstance(exc, grpc.RpcError):
            raise
        err = _rpc_error(exc, endpoint.address if endpoint else "?", args.timeout)
        print(f"dataplane: error: {err}", file=sys.stderr, flush=True)
        return err.exit_code
    finally:
        if endpoint is not None:
            endpoint.close()
