"""The controller finds its storage units by name.

The controller takes the units' names, not their actor handles, as constructor
arguments: Ray keeps constructor arguments that hold actor handles in the object
store of the process that created the actor, so a restart would depend on that
process still living (Ray logs an error line for it at every start). Names are
plain strings, sent inline, and resolve again on every restart.

A unit that is gone when the controller (re)starts has no name to look up any
more; it gets a tombstone instead: a handle of a tiny actor killed at once, so
every call to it raises ``RayActorError`` exactly like a call to the dead unit,
and recovery, liveness and clients count that unit lost as before.
"""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class _Tombstone:
    def ping(self) -> None:  # never answered: the actor is killed before any call
        return None


def tombstone():
    """A handle every call to which raises ``RayActorError``."""
    handle = _Tombstone.remote()
    ray.kill(handle, no_restart=True)
    return handle


def resolve(units: list, namespace: str | None) -> list:
    """Actor handles for ``units`` (names, or handles passed through unchanged)."""
    out = []
    for unit in units:
        if not isinstance(unit, str):
            out.append(unit)
            continue
        try:
            out.append(ray.get_actor(unit, namespace=namespace))
        except ValueError:  # no live actor has that name: the unit died
            out.append(tombstone())
    return out
