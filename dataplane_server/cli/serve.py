"""``dataplane serve``: run the service until SIGTERM / SIGINT, then drain and stop.

With no Ray address (flag or ``RAY_ADDRESS``) it starts an embedded Ray on
loopback, which lives as long as this process. With one it joins that cluster
(``auto`` resolved as Ray resolves it, a loopback cluster joined on loopback as
``connect`` joins it) within ``--timeout``, or ends as one error line, exit 1.
It prints where everything is: the Ray address, the admin and metrics endpoints,
and the lines a trainer pastes to connect (with what to set when Ray token auth is
on). With ``drain_checkpoint_dir`` set, the drain ends with a checkpoint of the
whole store; if that save fails the command exits 1, so an orchestrator sees it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import tempfile
import threading
import time

from dataplane_server.cli import preflight
from dataplane_server.cli.argtypes import positive_int, positive_seconds
from dataplane_server.cli.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError
from dataplane_server.cli.render import say
from dataplane_server.launch.stop_signal import StopSignal

DEFAULT_NUM_CPUS = 8  # logical slots for the embedded Ray; actors need them even when idle
# Joining a cluster that answers takes a second or two; this leaves room for a slow
# network or a head still starting, and still ends a join that never completes.
DEFAULT_JOIN_TIMEOUT_S = 60.0


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the service until SIGTERM/SIGINT, then drain")
    p.add_argument(
        "--config",
        metavar="FILE",
        help="DataPlaneConfig: a .yaml / .yml (YAML) or .json (JSON) file",
    )
    p.add_argument(
        "--address",
        "--ray-address",
        dest="address",
        help="Ray cluster address, e.g. auto (default: $RAY_ADDRESS, else an embedded "
        "local Ray on loopback)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=DEFAULT_JOIN_TIMEOUT_S,
        metavar="SECONDS",
        help="how long joining the Ray cluster at --address / $RAY_ADDRESS may take; a "
        "cluster not joined by then (or a SIGTERM/SIGINT meanwhile) ends serve with one "
        "error line naming the address, exit 1 (default %(default)g; the embedded Ray "
        "does not wait on it)",
    )
    p.add_argument(
        "--num-cpus",
        type=positive_int,
        default=DEFAULT_NUM_CPUS,
        help="logical CPUs of the embedded Ray (default %(default)s)",
    )
    p.add_argument(
        "--state-dir",
        metavar="DIR",
        help="serve from (and keep) the durable state in DIR: every sample, cursor, lease "
        "and policy version committed there by an earlier serve comes back; sets the "
        "config's state_dir, and durability process unless the config or --durability "
        "says machine",
    )
    p.add_argument(
        "--durability",
        choices=["memory", "process", "machine"],
        help="override the config's durability (see DataPlaneConfig.durability)",
    )
    p.add_argument("--ray-logs", action="store_true", help="forward actor logs to stdout")
    p.set_defaults(run=run)


def load_config(path: str | None, overrides: dict | None = None):
    """The config (``overrides`` set over the file's values), or a one-line usage error
    naming the bad key (no traceback)."""
    from dataplane_client.wire.config import DataPlaneConfig
    from dataplane_client.wire.errors import ConfigError

    try:
        config = DataPlaneConfig.from_file(path) if path else DataPlaneConfig()
        if overrides:
            config = DataPlaneConfig.from_dict(
                {**config.model_dump(exclude_defaults=True), **overrides}
            )
        return config
    except ConfigError as exc:
        raise CliError(f"config error: {exc}", EXIT_USAGE) from None


def durable_overrides(args, path: str | None) -> dict:
    """What ``--state-dir`` / ``--durability`` set over the config file."""
    out: dict = {}
    if getattr(args, "durability", None):
        out["durability"] = args.durability
    if getattr(args, "state_dir", None):
        out["state_dir"] = args.state_dir
        if "durability" not in out and load_config(path).durability == "memory":
            out["durability"] = "process"  # a state directory is asked for: keep state
    return out


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


def _init_ray(args, namespace: str) -> bool:
    """Join the cluster the flag or ``RAY_ADDRESS`` names, else start an embedded Ray on
    loopback; True when it joined one."""
    from dataplane_server.launch.local_ray import init_local_ray

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:  # an existing cluster (inside `ray job submit`, RAY_ADDRESS is set)
        origin = "--address" if args.address else "RAY_ADDRESS"
        _join_ray(address, origin, args.timeout, namespace=namespace, log_to_driver=args.ray_logs)
    else:
        init_local_ray(args.num_cpus, namespace=namespace, log_to_driver=args.ray_logs)
    return bool(address)


def _join_ray(address: str, origin: str, timeout_s: float, **init_kwargs) -> None:
    """Join the cluster at ``address`` within ``timeout_s``, or end as one error line.

    The same steps as ``connect``'s join (``loopback.join_address``): ``auto`` resolved
    first, and a loopback address kept on loopback (else Ray looked for the cluster
    at the machine's own address and retried for minutes). Then something must answer
    on the address (``preflight``), and ``ray.init`` must return, all before the
    deadline (:class:`JoinDeadline`).
    """
    import ray

    from dataplane_client.transport.loopback import join_address

    with JoinDeadline(repr(address), timeout_s) as deadline:
        try:
            target = join_address(address)
        except ConnectionError as exc:
            raise CliError(
                f"cannot join the Ray cluster at {address!r} ({origin}): {_first_line(exc)}"
            ) from None
        if target != address:
            deadline.where = f"{target!r} ({origin} {address!r})"
        try:
            preflight.check_ray_address(target)
        except CliError as exc:
            if target != address:
                raise CliError(f"{exc} ({origin} {address!r})", exc.exit_code) from None
            raise
        try:
            ray.init(address=target, **init_kwargs)
        except (ConnectionError, RuntimeError) as exc:
            raise CliError(
                f"cannot join the Ray cluster at {deadline.where}: {_first_line(exc)}"
            ) from None


# Ray's log prefixes: its C++ core's ("[time W pid tid] file.cc:12: ") and Python's.
_RAY_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|^\d{4}-\d\d-\d\d [\d:,.]+\s+\w+\s+\S+ -- ")


class JoinDeadline:
    """Joining a Ray cluster, bounded: one error line and exit 1 at the deadline, or at
    a SIGTERM / SIGINT on the way, whatever Ray is doing then.

    ``ray.init`` on a cluster that does not answer retries inside Ray's C++ core for
    minutes, and Python runs no signal handler until that returns (a SIGTERM took 25 s
    to act). So a watcher thread ends the process itself (Ray releases the GIL while
    it waits): at the deadline, or when a signal's number reaches it through
    ``signal.set_wakeup_fd``, which the C-level handler writes at once. Nothing needs
    stopping then: a driver joining a cluster has started no process of its own.

    Ray's messages of the meantime (its retries name addresses and timeouts of its
    own) go to a file while the join lasts: written to stderr after a join that
    succeeded, left out after one that failed (the deadline's or a signal's error line
    quotes the last of them).
    """

    def __init__(self, where: str, timeout_s: float) -> None:
        self.where = where  # the address tried, as the error line names it
        self.timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._done = False
        self._signal: int | None = None

    def __enter__(self) -> JoinDeadline:
        sys.stderr.flush()
        self._stderr = os.dup(2)
        self._held = tempfile.TemporaryFile()
        os.dup2(self._held.fileno(), 2)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        # Python-level handlers, so the signal reaches the wakeup fd instead of ending the
        # process silently (SIGTERM's default) or as a KeyboardInterrupt traceback.
        # ray.init puts its own on SIGTERM, a Python one as well.
        self._old_handlers = {
            signum: signal.signal(signum, self._on_signal)
            for signum in (signal.SIGTERM, signal.SIGINT)
        }
        self._watcher = threading.Thread(target=self._watch, name="join-deadline", daemon=True)
        self._watcher.start()
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self._signal = signum  # no lock, no I/O: the watcher acts on it

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            # SystemExit from Ray's SIGTERM handler, or a KeyboardInterrupt: the watcher
            # got the same signal and ends the process with the error line.
            self._watcher.join(timeout=5)
        with self._lock:
            self._done = True
        os.write(self._wake_w, b"\0")  # not a signal number: wakes the watcher to return
        self._watcher.join()
        signal.set_wakeup_fd(self._old_wakeup)
        for signum, handler in self._old_handlers.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        os.close(self._wake_r)
        os.close(self._wake_w)
        sys.stderr.flush()
        os.dup2(self._stderr, 2)
        if exc_type is None:  # joined: what Ray said on the way is worth seeing
            self._held.seek(0)
            os.write(2, self._held.read())
        os.close(self._stderr)
        self._held.close()

    def _watch(self) -> None:
        while True:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self._give_up(
                    f"cannot join the Ray cluster at {self.where} within "
                    f"{self.timeout_s:g} s (--timeout)"
                )
                return
            ready, _, _ = select.select([self._wake_r], [], [], left)
            if not ready:
                continue
            got = os.read(self._wake_r, 64)
            with self._lock:
                if self._done:
                    return
            stops = [n for n in got if n in (signal.SIGTERM, signal.SIGINT)]
            signum = stops[0] if stops else self._signal
            if signum is not None:
                name = signal.Signals(signum).name
                self._give_up(f"{name} while joining the Ray cluster at {self.where}: stopped")
                return

    def _give_up(self, message: str) -> None:
        """Write the one error line and end the process (unless the join just ended)."""
        with self._lock:
            if self._done:
                return
            said = self._ray_said()
            line = f"dataplane: error: {message}" + (f" (Ray: {said})" if said else "")
            os.write(self._stderr, (line + "\n").encode())
            os._exit(EXIT_FAILED)

    def _ray_said(self) -> str:
        """Ray's last message of the join, without its log prefix ('' if none)."""
        fd = self._held.fileno()
        size = os.fstat(fd).st_size
        text = os.pread(fd, 8192, max(0, size - 8192)).decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return _RAY_LOG_PREFIX.sub("", lines[-1])[:200] if lines else ""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def save_drain_checkpoint(handle, parent: str) -> bool:
    """Checkpoint the drained store into a new ``drain-<UTC time>`` folder of ``parent``."""
    from ray.exceptions import RayError

    from dataplane_client.wire.errors import DataPlaneError

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
    config = load_config(args.config, durable_overrides(args, args.config))
    # What can be checked before anything starts is checked here, each as one line.
    preflight.check_files(config)
    preflight.check_ports(config)
    joined = _init_ray(args, config.namespace)  # a cluster's address is checked as it is joined
    import ray
    from ray.exceptions import RayError

    from dataplane_client.transport.loopback import is_loopback
    from dataplane_client.wire.errors import ConfigError
    from dataplane_server.launch.service import start

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
    say(f"durability={config.durability} state_dir={config.state_dir or ''}")
    hint = token_auth_hint()
    for line in connect_snippet(ray_address, config.name, config.namespace, hint is not None):
        say(line)
    if hint:
        say(hint)
    if is_loopback(ray_address) and not joined:
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
