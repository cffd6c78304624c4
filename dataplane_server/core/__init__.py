"""The Ray-free core of the service: what runs with no Ray at all.

The key space and its claim policies, the journal, recovery's logic, the checkpoint
file format, retention, a storage unit's store (arena, leases, partitions, undo,
previews, its checkpoint files), the counters, the admin views, and the in-process
client built on them. The actor shells at the top level of ``dataplane_server``
wrap these; nothing here imports them, Ray, or the operations surface (``admin``,
``cli``): import-linter's contracts in ``pyproject.toml`` keep it so, and
``tests/core/test_core_imports.py`` imports each module for real without Ray.
"""
