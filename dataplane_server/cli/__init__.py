"""``dataplane``: run the service, and look inside a running one through its admin endpoint.

    dataplane serve --config dataplane.yaml        # until SIGTERM / SIGINT, then drain
    dataplane status      --address HOST:PORT      # service, units, totals
    dataplane partitions  --address HOST:PORT
    dataplane describe P  --address HOST:PORT
    dataplane samples P   --address HOST:PORT [--status ready] [--page-size 50] [--page-token T]
    dataplane sample P ID --address HOST:PORT      # one sample + a preview of its values
    dataplane clear P [ID ...] --address HOST:PORT --token T
    dataplane delete P    --address HOST:PORT --token T
    dataplane watch       --address HOST:PORT [--interval 1] [--count N]
    dataplane checkpoint save|restore DIR --address HOST:PORT --token T
    dataplane demo ...                             # and any other dataplane.commands entry point

One module per subcommand; the shared parts are ``endpoint`` (options,
channel, what an RPC error means), ``convert`` (protobuf -> builtins),
``render`` (tables) and ``exits`` (exit codes). Client commands read
``DATAPLANE_ADMIN_ADDRESS`` / ``DATAPLANE_ADMIN_TOKEN`` when --address / --token
are not given, print tables (``--json`` for scripts), and exit with 1 on a
refused request, 2 on a usage error, 3 when the endpoint cannot be reached or
a watch stream drops, 4 when the token is missing or wrong, and quietly with 141
(128 + SIGPIPE) when the reader of their output goes away (`| head`).
"""

# E402: grpc must be imported after GRPC_VERBOSITY is set, so imports follow code here.
# ruff: noqa: E402
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import EntryPoint

# gRPC's core logs failed handshakes to stderr itself; the CLI reports them in one line.
# Read once when grpc is imported; a user's own setting wins, and it is not left in the
# environment for the processes `serve` starts (Ray's own gRPC logging stays as it was).
_QUIET_GRPC = "GRPC_VERBOSITY" not in os.environ
if _QUIET_GRPC:
    os.environ["GRPC_VERBOSITY"] = "NONE"
import grpc

if _QUIET_GRPC:
    del os.environ["GRPC_VERBOSITY"]

from dataplane_server.cli import (
    checkpoint,
    clear,
    delete,
    describe,
    partitions,
    plugins,
    sample,
    samples,
    serve,
    status,
    watch,
)
from dataplane_server.cli.endpoint import AdminEndpoint, endpoint_options
from dataplane_server.cli.exits import EPILOG, EXIT_OK, EXIT_PIPE, CliError

CLIENT_COMMANDS = (
    status,
    partitions,
    describe,
    samples,
    sample,
    clear,
    delete,
    watch,
    checkpoint,
)


class _VersionAction(argparse.Action):
    """``--version``: the one version source, ``dataplane_client.wire.version``, imported only
    when asked (importing the client package pulls in Ray and torch, which the other
    client commands never load)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest=dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from dataplane_client.wire.version import __version__

        print(f"dataplane {__version__}", flush=True)  # stdout, as argparse's own action
        parser.exit()


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, EntryPoint]]:
    """The parser, and the entry-point commands it lists (built-in names win)."""
    parser = argparse.ArgumentParser(
        prog="dataplane",
        description="Run the data-plane service, or inspect a running one.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(sub)
    common = endpoint_options()
    for command in CLIENT_COMMANDS:
        command.register(sub, common)
    added = plugins.register(sub, plugins.commands())
    return parser, added


def _fail(err: CliError) -> int:
    print(f"dataplane: error: {err}", file=sys.stderr, flush=True)
    return err.exit_code


def _run_endpoint_command(args: argparse.Namespace) -> int:
    endpoint = AdminEndpoint(args)
    try:
        args.endpoint_cmd(endpoint, args)
    except grpc.RpcError as exc:
        return _fail(endpoint.error(exc))
    finally:
        endpoint.close()
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`dataplane status | head -3`): nothing more can be
    shown, which is no error worth a traceback. stdout is pointed at /dev/null so the
    interpreter's last flush at exit does not fail on the closed pipe again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, added = build_parser()
    try:
        if argv and argv[0] in added:  # their own parsers own every argument after the name
            return plugins.run(added[argv[0]], argv[1:])
        args = parser.parse_args(argv)
        if hasattr(args, "run"):
            return args.run(args)
        return _run_endpoint_command(args)
    except CliError as err:
        return _fail(err)
