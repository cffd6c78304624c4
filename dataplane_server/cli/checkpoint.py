"""``dataplane checkpoint save|restore DIR``: the whole store to a directory and back.

DIR is a path on the service's nodes (the controller's, reachable from every
storage unit's node). A relative DIR is made absolute against this shell's
working directory, which is right when the CLI runs on the service's node.
Both need the token when the service has one. A save or restore moves every
byte, so these commands wait up to 600 s unless --timeout says otherwise.
"""

from __future__ import annotations

import os

from dataplane_server.admin_pb import admin_pb2
from dataplane_server.cli.convert import to_builtin
from dataplane_server.cli.render import emit_json, say

DEFAULT_TIMEOUT_S = 600.0


# action -> (RPC, its request, what it does, what it says when done)
ACTIONS = {
    "save": (
        "SaveCheckpoint",
        admin_pb2.SaveCheckpointRequest,
        "write every partition, sample and cursor, as of one instant, to DIR (must not exist)",
        "saved checkpoint {directory}",
    ),
    "restore": (
        "RestoreCheckpoint",
        admin_pb2.RestoreCheckpointRequest,
        "load DIR into this service, which must hold no partition",
        "restored {restored_samples} samples from {directory}",
    ),
}


def register(sub, endpoint_options) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="save the whole store to a directory, or restore it into an empty service",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, (_, _, text, _) in ACTIONS.items():
        a = actions.add_parser(name, parents=[endpoint_options], help=f"{text} (needs the token)")
        a.add_argument("directory", metavar="DIR", help="path on the service's nodes")
        if name == "save":
            a.add_argument(
                "--parent",
                metavar="DIR",
                help="an earlier checkpoint: copy only bytes new since it, link the rest",
            )
        # Instead of the 5 s other commands wait: this moves the whole store.
        a.set_defaults(endpoint_cmd=run, default_timeout=DEFAULT_TIMEOUT_S)


def run(ep, args) -> None:
    method, request, _, done = ACTIONS[args.action]
    given = {"directory": os.path.abspath(args.directory)}
    if getattr(args, "parent", None):
        given["parent"] = os.path.abspath(args.parent)
    got = to_builtin(ep.call(method, request(**given)))
    if args.json:
        return emit_json(got)
    say(done.format(**got))
