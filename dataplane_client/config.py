"""The one typed place for data-plane configuration, with readable defaults.

A YAML/JSON file (``dataplane serve --config FILE``) maps 1:1 onto these
fields; unknown keys are rejected so a typo never silently falls back to a
default. ``deploy/dataplane.example.yaml`` documents every option.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from dataplane_client.errors import InvalidBatch

GiB = 1 << 30


@dataclass
class DataPlaneConfig:
    # --- identity: how clients find the service --------------------------------
    name: str = "dataplane"  # the controller actor's name
    namespace: str = "dataplane"  # Ray namespace of the controller and units

    # --- storage ----------------------------------------------------------------
    num_storage_units: int = 2
    unit_capacity_bytes: int = 4 * GiB  # per unit; a put beyond it waits or fails
    # How long a put waits for room when a unit is full; 0 = raise CapacityExceeded at once.
    put_wait_timeout_s: float = 0.0
    # Pre-faulted shared memory a unit keeps ready for writes of the sizes it has seen
    # (taken off the write path; held in addition to the data). 0 disables it.
    unit_warm_reserve_bytes: int = 256 << 20
    # Bytes staged by a put that is never committed are reclaimed after this many seconds
    # (and at once when the writer's process dies).
    stage_ttl_s: float = 30.0
    # Logical CPUs reserved per actor. 0 keeps the service from starving workers of
    # scheduling slots on small machines; raise it to pin resources in production.
    controller_num_cpus: float = 0.0
    unit_num_cpus: float = 0.0

    # --- admin endpoint (gRPC) ------------------------------------------------------
    admin_enabled: bool = True
    admin_host: str = "127.0.0.1"  # loopback by default: expose deliberately
    admin_port: int = 0  # 0 = pick a free port (printed / on the handle)
    # Bearer token for mutating RPCs; also read from DATAPLANE_ADMIN_TOKEN.
    admin_token: str | None = None
    admin_token_for_reads: bool = False  # require the token for every RPC, reads too
    admin_tls_cert: str | None = None  # PEM paths; both set = TLS
    admin_tls_key: str | None = None
    admin_max_request_bytes: int = 1 << 20
    admin_max_workers: int = 8

    # --- metrics (Prometheus text format over HTTP) -----------------------------------
    metrics_enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # 0 = pick a free port

    # --- drain ------------------------------------------------------------------
    drain_timeout_s: float = 30.0  # how long SIGTERM waits for in-flight requests

    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_storage_units < 1:
            raise InvalidBatch(f"num_storage_units must be >= 1, got {self.num_storage_units}")
        if self.unit_capacity_bytes <= 0:
            raise InvalidBatch(f"unit_capacity_bytes must be > 0, got {self.unit_capacity_bytes}")
        if self.put_wait_timeout_s < 0:
            raise InvalidBatch(f"put_wait_timeout_s must be >= 0, got {self.put_wait_timeout_s}")
        if self.admin_token is None:
            self.admin_token = os.environ.get("DATAPLANE_ADMIN_TOKEN") or None
        if bool(self.admin_tls_cert) != bool(self.admin_tls_key):
            raise InvalidBatch("admin_tls_cert and admin_tls_key must be set together")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DataPlaneConfig:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidBatch(f"unknown config keys {unknown}; known keys: {sorted(known)}")
        return cls(**raw)

    @classmethod
    def from_file(cls, path: str) -> DataPlaneConfig:
        with open(path) as f:
            text = f.read()
        if path.endswith((".yaml", ".yml")):
            import yaml  # ray[default] brings PyYAML

            raw = yaml.safe_load(text) or {}
        else:
            import json

            raw = json.loads(text)
        if not isinstance(raw, dict):
            raise InvalidBatch(f"config file {path} must hold a mapping, got {type(raw).__name__}")
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
