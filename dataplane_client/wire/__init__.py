"""The wire vocabulary both sides speak: typed messages and errors, argument checks,
the meta, config, encoded fields and their shared-memory chunks. No Ray, no torch
at import: the server's core imports it."""
