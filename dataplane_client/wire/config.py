"""The one typed place for data-plane configuration, validated when it is built.

Where values come from, highest precedence first:

1. keyword arguments in code, or the keys of ``from_dict`` (a complete dict, as
   ``to_dict`` produces, never consults the environment again); the actors get
   the config object itself (pickled, not rebuilt), so every process of one
   service sees the same values;
2. environment variables ``DATAPLANE_<FIELD>`` (``DATAPLANE_ADMIN_TOKEN``,
   ``DATAPLANE_METRICS_PORT=9464``, ...) for fields not given explicitly; an
   empty variable counts as unset; any other ``DATAPLANE_*`` variable (not in
   ``NOT_CONFIG_ENV``) is a ConfigError naming the closest key, as an unknown
   YAML key is;
3. a config file (``from_file``): the deployment's own defaults, which the
   environment overrides so a secret can be injected next to a ConfigMap;
4. the defaults below.

Values are checked strictly: a YAML ``admin_port: "50051"`` is rejected, not
coerced, because a quoted number in a config file is more often a templating
mistake than an intent, and coercing some strings but not others (``"5e4"``?
``"0x1F"``?) is a rule nobody remembers. Environment variables are always
strings, so they alone are parsed from text. Byte sizes take an int or a string
with a unit (``16GiB``, ``512MiB``, ``4G``). Every failure raises
:class:`~dataplane_client.wire.errors.ConfigError` naming the key and the bad value.
``deploy/dataplane.example.yaml`` and ``deploy/README.md`` document every
field; ``tests/client/test_config.py`` keeps them in step with this model.
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
from decimal import Decimal
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from dataplane_client.wire.errors import ConfigError

ENV_PREFIX = "DATAPLANE_"
# ``DATAPLANE_*`` variables that are not config keys, each with who reads it; any other
# ``DATAPLANE_*`` variable that is not ``DATAPLANE_<FIELD>`` is a ConfigError (a typo).
NOT_CONFIG_ENV = frozenset(
    {
        "DATAPLANE_ADMIN_ADDRESS",  # the CLI's default --address (dataplane_server/cli/endpoint.py)
    }
)

# SI prefixes are powers of 1000 and IEC ("Ki", "Mi", ...) powers of 1024, as in
# Kubernetes quantities; a trailing "B" is optional ("4G" == "4GB" == 4 * 10**9).
_BYTE_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KI": 1 << 10,
    "MI": 1 << 20,
    "GI": 1 << 30,
    "TI": 1 << 40,
}
_BYTE_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?B?\s*", re.IGNORECASE)


def parse_byte_size(value: Any) -> Any:
    """``16GiB`` / ``512MiB`` / ``4G`` / ``1024`` -> a whole number of bytes.

    Anything that is not a string is passed through for the int check to judge,
    so a float or a bool is rejected there with pydantic's message.
    """
    if not isinstance(value, str):
        return value
    match = _BYTE_SIZE.fullmatch(value)
    if match is None:
        raise ValueError("not a byte size; use an integer or e.g. '512MiB', '16GiB', '4G'")
    number, unit = match.group(1), (match.group(2) or "").upper()
    size = Decimal(number) * _BYTE_UNITS[unit]  # Decimal: "1.5GiB" is exact, no float rounding
    if size != size.to_integral_value():
        raise ValueError("not a whole number of bytes")
    return int(size)


ByteSize = Annotated[int, BeforeValidator(parse_byte_size)]
Port = Annotated[int, Field(ge=0, le=65535)]


class DataPlaneConfig(BaseModel):
    """Every setting of one data-plane service (controller, storage units, admin, metrics)."""

    # strict: see the module docstring. frozen: a config is a value shared with actors;
    # changing it after start() would silently disagree with what the actors run with.
    model_config = ConfigDict(strict=True, frozen=True, allow_inf_nan=False, extra="forbid")

    # --- identity: how clients find the service --------------------------------
    name: str = Field("dataplane", min_length=1, description="Name of the controller actor.")
    namespace: str = Field(
        "dataplane", min_length=1, description="Ray namespace of the controller and the units."
    )

    # --- storage ----------------------------------------------------------------
    num_storage_units: int = Field(
        0,
        ge=0,
        description="Storage-unit actors, spread over the cluster's alive nodes; 0 = one per "
        "alive node at start (the fast layout: a same-node get reads one unit, zero-copy).",
    )
    unit_capacity_bytes: ByteSize = Field(
        4 << 30, gt=0, description="Bytes one unit may hold; a put beyond it waits or fails."
    )
    put_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        description="Seconds a put waits for room in a full unit; 0 = off "
        "(raise CapacityExceeded at once).",
    )
    unit_warm_reserve_bytes: ByteSize = Field(
        256 << 20,
        ge=0,
        description="Pre-faulted shared memory a unit keeps ready for writes of the sizes "
        "it has seen (held in addition to the data): chunks made ahead, and freed chunks no "
        "reader maps; at least this, or the largest write seen; 0 = off.",
    )
    stage_ttl_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a put has from its admission to its commit (its deadline: a "
        "stage or commit arriving later is refused with Overloaded, before any work); staged "
        "bytes nobody commits are reclaimed shortly after it (at once when the writer's "
        "process dies). Must be > 0.",
    )
    put_credits: int = Field(
        256,
        ge=1,
        description="Puts one client process may have staging or committing at once; more "
        "wait for a credit, in arrival order, before any byte is staged.",
    )
    put_admission_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a put waits for a credit before it fails with Overloaded "
        "(retryable; nothing was staged).",
    )
    put_queue_limit: int = Field(
        65536,
        ge=0,
        description="Puts one client process may have waiting for a credit; one more fails "
        "with Overloaded at once.",
    )
    controller_num_cpus: float = Field(
        0.0, ge=0, description="Logical CPUs reserved for the controller actor (0 = none)."
    )
    unit_num_cpus: float = Field(
        0.0, ge=0, description="Logical CPUs reserved per storage unit (0 = none)."
    )
    copy_threads: int | None = Field(
        None,
        ge=1,
        description="Threads a large copy (16 MiB or more) is split over, in units and "
        "clients; 1 = off; None = the CPUs the process may run on, at most 4.",
    )

    # --- reliability ---------------------------------------------------------------
    controller_max_restarts: int = Field(
        -1, ge=-1, description="Times Ray restarts a crashed controller (-1 = always)."
    )
    controller_state_dir: str | None = Field(
        None,
        description="Directory of the controller's journal (declarations, cursors, leases) "
        "on its node; None = a fresh temporary directory per service.",
    )
    durability: str = Field(
        "memory",
        pattern="^(memory|process|machine)$",
        description="What a committed sample survives: memory = nothing (a unit's death "
        "loses its samples); process = any process's death, the whole service's too "
        "(chunks and row index as files on RAM, /dev/shm; lost on reboot); machine = a "
        "machine crash as well (files on the disk under state_dir, flushed per "
        "fsync_policy). process and machine need state_dir.",
    )
    state_dir: str | None = Field(
        None,
        description="The service's durable state (durability process or machine): the "
        "controller's journal (unless controller_state_dir names another), and at machine "
        "level each unit's chunk files and row index. `dataplane serve --state-dir` and "
        "start() with the same directory serve everything committed there again.",
    )
    fsync_policy: str = Field(
        "interval",
        pattern="^(commit|interval)$",
        description="durability machine: commit = each commit's bytes and record reach the "
        "disk before it returns (Redis appendfsync always); interval = a flush every "
        "fsync_interval_s (Kafka flush.ms, Redis everysec): a machine crash loses at most "
        "that much, never a sample's bytes under its record.",
    )
    fsync_interval_s: float = Field(1.0, gt=0, description="durability machine, interval.")
    journal_fsync: bool = Field(
        False,
        description="fsync every journal record: survives a machine crash, not only the "
        "controller's process (slower claims).",
    )
    checkpoint_copy_share: float = Field(
        0.02,
        gt=0,
        le=1,
        description="The share of one core each unit's checkpoint copy keeps busy at most "
        "(it rests in between), so puts and claims beside it slow by little while it runs "
        "and the checkpoint takes longer instead; 1 = as fast as it can. A drain's "
        "checkpoint always runs at 1.",
    )
    controller_retry_budget_s: float = Field(
        60.0,
        gt=0,
        description="How long a client waits for a restarting controller before raising "
        "ServiceUnavailable.",
    )
    liveness_interval_s: float = Field(
        1.0, gt=0, description="Seconds between the controller's checks of unit and node liveness."
    )
    replicas: int = Field(
        1,
        ge=1,
        le=2,
        description="Copies of each sample, on units of two different nodes: 2 = losing one "
        "unit or node loses no sample (needs units on two nodes; puts write twice).",
    )
    retain_emptied_partitions: int | None = Field(
        None,
        ge=0,
        description="Keep only this many partitions emptied by clears (older ones are "
        "deleted); None = keep all.",
    )
    retain_emptied_partitions_s: float | None = Field(
        None,
        ge=0,
        description="Delete a partition emptied by clears this many seconds ago; None = never.",
    )

    # --- bytes across nodes (dataplane_client/transport/payload) -----------------
    cross_node_transport: str = Field(
        "auto",
        pattern="^(auto|tcp|ray)$",
        description="How a get moves bytes from a unit on another node: auto = Mooncake's "
        "transfer engine where both ends have it and a probe at connect passes (over RDMA "
        "where its engine finds an active RDMA device, else TCP; both ends must agree), "
        "else Ray's object transfer (the reason logged once); tcp = the same, Mooncake kept "
        "on TCP everywhere (for clusters where some nodes have no RDMA device); ray = "
        "always Ray's.",
    )
    transfer_puts: bool = Field(
        False,
        description="Cross-node puts of more than 1 MiB per unit also go through the transfer "
        "engine (the writer pushes into the unit's region, CRC-32 checked before the "
        "commit); off: through Ray's call arguments (measured faster here for fresh "
        "128 MiB writes, see benchmarks/README.md).",
    )
    transfer_min_bytes: ByteSize = Field(
        64 << 10,
        ge=0,
        description="Fields of a cross-node get smaller than this come back inside the "
        "unit's answer instead of through the transfer engine (a pull costs a round trip).",
    )

    # --- admin endpoint (gRPC) ---------------------------------------------------
    admin_enabled: bool = Field(True, description="Start the gRPC admin endpoint.")
    admin_host: str = Field(
        "127.0.0.1", min_length=1, description="Bind address; loopback unless exposed on purpose."
    )
    admin_port: Port = Field(0, description="Admin port; 0 = any free port (printed at start).")
    # repr=False: the token must not end up in logs that print the config.
    admin_token: str | None = Field(
        None,
        min_length=1,
        repr=False,
        description="Bearer token: required for mutations and for every RPC that returns "
        "partition or sample data; set DATAPLANE_ADMIN_TOKEN, not the file.",
    )
    admin_token_for_reads: bool = Field(
        False,
        description="Also require the token for service info and reflection "
        "(only health stays open).",
    )
    admin_tls_cert: str | None = Field(
        None, min_length=1, description="PEM certificate file; with admin_tls_key = TLS."
    )
    admin_tls_key: str | None = Field(
        None, min_length=1, description="PEM private key file of admin_tls_cert."
    )
    admin_max_request_bytes: ByteSize = Field(
        1 << 20, gt=0, description="Largest admin request accepted (RESOURCE_EXHAUSTED above)."
    )
    # >= 2: at most half of the threads hold WatchStats streams, so one thread could be
    # taken by a single watcher and starve every other RPC.
    admin_max_workers: int = Field(
        8, ge=2, description="Threads serving admin RPCs; at most half hold WatchStats streams."
    )

    # --- metrics (Prometheus text format over HTTP) --------------------------------
    metrics_enabled: bool = Field(True, description="Serve Prometheus /metrics.")
    metrics_host: str = Field(
        "127.0.0.1", min_length=1, description="Bind address of /metrics (no auth: keep internal)."
    )
    metrics_port: Port = Field(0, description="Metrics port; 0 = any free port.")

    # --- drain --------------------------------------------------------------------
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, seconds in-flight admin RPCs get to finish; 0 = off "
        "(stop at once).",
    )
    drain_checkpoint_dir: str | None = Field(
        None,
        description="On SIGTERM, save a checkpoint of the whole store in a new "
        "drain-<UTC time> folder here before stopping (reachable from every unit's node); "
        "None = no checkpoint.",
    )

    def __init__(self, **values: Any) -> None:
        _reject_unknown(values)
        from_env = _environment_values(exclude=values)
        try:
            super().__init__(**values, **_parse_env(from_env))
        except ValidationError as exc:
            raise _config_error(exc, from_env) from None

    @model_validator(mode="after")
    def _durable_needs_a_directory(self) -> DataPlaneConfig:
        if self.durability != "memory" and not self.state_dir:
            raise ValueError(f"durability {self.durability!r} needs state_dir (where it lives)")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> DataPlaneConfig:
        if (self.admin_tls_cert is None) != (self.admin_tls_key is None):
            raise ValueError("admin_tls_cert and admin_tls_key must be set together")
        return self

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DataPlaneConfig:
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a mapping, got {type(raw).__name__}")
        bad_keys = [k for k in raw if not isinstance(k, str)]
        if bad_keys:
            raise ConfigError(f"config keys must be strings, got {bad_keys!r}")
        return cls(**raw)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DataPlaneConfig:
        """A file of field: value: a ``.json`` name as strict JSON (a trailing comma is an
        error, not YAML's reading of it), any other (``.yaml``, or a Kubernetes ConfigMap
        key with no suffix) as YAML; the environment overrides it."""
        name = os.fspath(path)
        suffix = os.path.splitext(name)[1].lower()
        try:
            with open(path) as f:
                raw = json.load(f) if suffix == ".json" else yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {name!r}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {name!r} is not valid JSON: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {name!r} is not valid YAML: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {name!r} is not UTF-8 text: {exc}") from None
        if raw is None:  # an empty file (or only comments): likely the wrong file
            raise ConfigError(
                f"config file {os.fspath(path)!r} is empty: give at least one key, or no "
                "config file for the defaults"
            )
        if not isinstance(raw, dict):
            raise ConfigError(
                f"config file {os.fspath(path)!r} must hold a mapping, got {type(raw).__name__}"
            )
        # The file is below the environment: drop its keys that the environment sets.
        overridden = _environment_values(exclude={})
        return cls.from_dict({k: v for k, v in raw.items() if k not in overridden})

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def env_var(field: str) -> str:
    """The environment variable that overrides ``field``."""
    return ENV_PREFIX + field.upper()


def _reject_unknown(values: dict[str, Any]) -> None:
    known = DataPlaneConfig.model_fields
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
            raise ConfigError(f"unknown config key {key!r}{hint}", fields=[str(key)])


def _reject_unknown_env() -> None:
    known = {env_var(name): name for name in DataPlaneConfig.model_fields}
    for var, value in os.environ.items():
        if not var.startswith(ENV_PREFIX) or var in known or var in NOT_CONFIG_ENV:
            continue
        if value == "":  # as for a known key: an empty variable counts as unset
            continue
        close = difflib.get_close_matches(var, list(known), n=1)
        hint = (
            f"; did you mean {close[0]} (config key {known[close[0]]!r})?"
            if close
            else f"; known keys: {sorted(known.values())}"
        )
        raise ConfigError(
            f"unknown config environment variable {var}{hint}",
            fields=[known[close[0]]] if close else [],
        )


def _environment_values(exclude: dict[str, Any]) -> dict[str, str]:
    _reject_unknown_env()
    out = {}
    for name in DataPlaneConfig.model_fields:
        value = os.environ.get(env_var(name), "")
        if name not in exclude and value != "":
            out[name] = value
    return out


@functools.cache
def _string_adapter(name: str) -> TypeAdapter[Any]:
    # The field's type with its constraints and validators, for parsing one env string.
    info = DataPlaneConfig.model_fields[name]
    field_type: Any = info.annotation  # built at run time from the field; no static type
    if not info.metadata:  # Annotated needs at least one piece of metadata
        return TypeAdapter(field_type)
    annotated: Any = Annotated
    return TypeAdapter(annotated[(field_type,) + tuple(info.metadata)])


def _parse_env(from_env: dict[str, str]) -> dict[str, Any]:
    parsed = {}
    for name, text in from_env.items():
        try:
            parsed[name] = _string_adapter(name).validate_strings(text)
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise ConfigError(
                f"invalid config value {env_var(name)}={text!r} (field {name!r}): {reason}",
                fields=[name],
            ) from None
    return parsed


_STRICT_TYPE_ERRORS = ("int_type", "float_type", "bool_type")


def _config_error(exc: ValidationError, from_env: dict[str, str]) -> ConfigError:
    problems, keys = [], []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        reason = err["msg"].removeprefix("Value error, ")
        if not key:  # a check across fields (the TLS pair) names its keys in its message
            problems.append(reason)
            keys += [name for name in DataPlaneConfig.model_fields if name in reason]
            continue
        if isinstance(err["input"], str) and err["type"] in _STRICT_TYPE_ERRORS:
            reason += " (strings are not converted: write the value unquoted)"
        keys.append(key)
        source = f" (from {env_var(key)})" if key in from_env else ""
        shown = "<hidden>" if key == "admin_token" else repr(err["input"])
        problems.append(f"invalid config value {key}={shown}{source}: {reason}")
    return ConfigError("; ".join(problems), fields=keys)
