"""How bulk bytes move between a unit and a process on another node: one backend per pair
of nodes, chosen at connect by a capability probe (``probe.choose``). Same-node bytes never
come here: they go through shared memory (``transport/bulk.py``)."""
