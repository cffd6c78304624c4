"""The Ray transport: the bulk-data seam to the units, batched calls and claims, put
admission, placement, actor states, loopback, Ray token-auth probe."""
