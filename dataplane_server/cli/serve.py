"""``dataplane serve``: run the service until SIGTERM / SIGINT, then drain and stop.

With no Ray address (flag or ``RAY_ADDRESS``) it starts an embedded Ray on
loopback, which lives as long as this process. It prints where everything is:
the Ray address, the admin and metrics endpoints, and the lines a trainer
pastes to connect (with what to set when Ray token auth is on). With
``drain_checkpoint_dir`` set, the drain ends with a checkpoint of the whole store;
if that save fails the command exits 1, so an orchestrator sees it.
"""

from __future__ import annotations

import os
import time

from dataplane_server.cli import preflight
from dataplane_server.cli.argtypes import positive_int
from dataplane_server.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError
from dataplane_server.cli.render import say
from dataplane_server.stop_signal import StopSignal

DEFAULT_NUM_CPUS = 8  # logical slots for the embedded Ray; actors need them even when idle


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the service until SIGTERM/SIGINT, then drain")
    p.add_argument("--config", metavar="FILE", help="YAML or JSON DataPlaneConfig")
    p.add_argument(
        "--address",
        "--ray-address",
        dest="address",
        help="Ray cluster address, e.g. auto (default: $RAY_ADDRESS, else an embedded "
        "local Ray on loopback)",
    )
    p.add_argument(
        "--num-cpus",
        type=positive_int,
        default=DEFAULT_NUM_CPUS,
        help="logical CPUs of the embedded Ray (default %(default)s)",
    )
    p.add_argument("--ray-logs", action="store_true", help="forward actor logs to stdout")
    p.set_defaults(run=run)


def load_config(path: str | None):
    """The config, or a one-line usage error naming the bad key (no traceback)."""
    from dataplane_client.config import DataPlaneConfig
    from dataplane_client.errors import ConfigError

    try:
        return DataPlaneConfig.from_file(path) if path else DataPlaneConfig()
    except ConfigError as exc:
        raise CliError(f"config error: {exc}", EXIT_USAGE) from None


def token_auth_hint() -> str | None:
    """What a connecting process must set when this Ray enforces token auth, else None.

    Ray records the mode it runs with in RAY_AUTH_MODE (it sets "token" itself
    when a new local cluster turns token auth on by default).
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        where = "RAY_AUTH_TOKEN (as set for this process)"
    elif os.environ.get("RAY_AUTH_TOKEN_PATH"):
        where = f"RAY_AUTH_TOKEN_PATH={os.environ['RAY_AUTH_TOKEN_PATH']}"
    else:
        where = "the token file ~/.ray/auth_token of this user (or RAY_AUTH_TOKEN)"
    return (
        "Ray token auth is on: a connecting process (and `ray job submit`) needs "
        f"RAY_AUTH_MODE=token before it imports ray, with the same token: {where}; on "
        "another machine, a copy of it named by RAY_AUTH_TOKEN_PATH"
    )


def connect_snippet(
    ray_address: str, name: str, namespace: str, token_auth: bool = False
) -> list[str]:
    """Lines a trainer pastes, as printed, into another process to reach this service.

    With token auth on, the snippet sets RAY_AUTH_MODE itself: Ray reads it only when
    ``ray`` is first imported, so it comes before the import (and the token file named
    by this process's RAY_AUTH_TOKEN_PATH, if any; never a token itself).
    """
    lines = ["connect from another process (paste as is):"]
    if token_auth:
        lines.append("    import os")
        lines.append('    os.environ["RAY_AUTH_MODE"] = "token"  # before ray is imported')
        if os.environ.get("RAY_AUTH_TOKEN_PATH"):
            path = os.environ["RAY_AUTH_TOKEN_PATH"]
            lines.append(f'    os.environ["RAY_AUTH_TOKEN_PATH"] = "{path}"')
    lines += [
        "    import dataplane_client",
        f'    client = dataplane_client.connect(name="{name}", namespace="{namespace}", '
        f'address="{ray_address}")',
    ]
    return lines


def _init_ray(args, namespace: str) -> None:
    import ray

    from dataplane_server.local_ray import init_local_ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:  # an existing cluster (inside `ray job submit`, RAY_ADDRESS is set)
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=args.ray_logs)
        except (ConnectionError, RuntimeError) as exc:
            raise CliError(
                f"cannot join the Ray cluster at {address!r}: {_first_line(exc)}"
            ) from None
    else:
        init_local_ray(args.num_cpus, namespace=namespace, log_to_driver=args.ray_logs)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def save_drain_checkpoint(handle, parent: str) -> bool:
    """Checkpoint the drained store into a new ``drain-<UTC time>`` folder of ``parent``."""
    from ray.exceptions import RayError

    from dataplane_client.errors import DataPlaneError

    path = os.path.join(parent, time.strftime("drain-%Y%m%dT%H%M%SZ", time.gmtime()))
    try:
        saved = handle.client().checkpoint(path)
    except (DataPlaneError, OSError, RayError) as exc:
        say(f"dataplane: error: drain checkpoint to {path} failed: {exc}")
        return False
    say(f"dataplane: drain checkpoint saved to {saved}")
    return True


def run(args) -> int:
    # Imported here: dataplane_client pulls in Ray and torch, which the client commands skip.
    config = load_config(args.config)
    # What can be checked before anything starts is checked here, each as one line.
    preflight.check_files(config)
    preflight.check_ports(config)
    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        preflight.check_ray_address(address)
    _init_ray(args, config.namespace)
    import ray
    from ray.exceptions import RayError

    from dataplane_client.errors import ConfigError
    from dataplane_client.loopback import is_loopback
    from dataplane_server.service import start

    stop = StopSignal().install()  # before start: a signal during it still drains

    try:
        handle = start(config)
    except ConfigError as exc:  # settings only the actors check (TLS contents, auth combos)
        raise CliError(f"config error: {exc}", EXIT_USAGE) from None
    except (RayError, OSError, RuntimeError) as exc:  # e.g. a port taken since the check
        raise CliError(f"the service did not start: {_first_line(exc)}") from None
    ray_address = ray.get_runtime_context().gcs_address
    say(f"dataplane: serving {config.name!r} in namespace {config.namespace!r}")
    say(f"ray_address={ray_address}")
    say(f"admin_address={handle.admin_address}")
    say(f"metrics_address={handle.metrics_address}")
    hint = token_auth_hint()
    for line in connect_snippet(ray_address, config.name, config.namespace, hint is not None):
        say(line)
    if hint:
        say(hint)
    if is_loopback(ray_address):
        say(
            "the embedded Ray listens on 127.0.0.1 (Ray's GCS port on every interface, "
            "token-checked): join from this machine, or serve with --address on a cluster"
        )
    stop.wait()
    say("dataplane: signal received, draining")
    saved = True
    try:
        handle.drain()
        if config.drain_checkpoint_dir:
            saved = save_drain_checkpoint(handle, config.drain_checkpoint_dir)
    finally:
        handle.shutdown()
    say("dataplane: stopped")
    return EXIT_OK if saved else EXIT_FAILED
