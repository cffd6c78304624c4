"""A storage unit's store without Ray: staging, publish, leases, reads, dump and load,
its arena of chunks and the warm reserve."""
