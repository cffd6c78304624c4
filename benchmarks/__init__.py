"""Benchmarks of the data plane against TransferQueue, the Ray object store and memcpy.

``python -m benchmarks.run`` (or ``dataplane bench``) runs every section in one
process tree; see ``benchmarks/README.md``.
"""
