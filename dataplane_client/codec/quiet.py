"""Drop one known log record that every jagged read triggers; nothing else.

torch logs that ``is_fx_tracing`` is deprecated the first time its own
``torch.nested.nested_tensor_from_jagged`` calls it, which happens whenever a
jagged field is read. It is advice to torch's developers that no caller can act
on, so only that record of that logger is dropped.
"""

from __future__ import annotations

import logging

_TORCH_FX_LOGGER = "torch.fx._symbolic_trace"
_FX_TRACING_NOTICE = "is_fx_tracing will return true"


class _DropPrefix(logging.Filter):
    """Drops a logger's records whose message starts with ``prefix``."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def drop_torch_fx_tracing_notice() -> None:
    """Install the filter once per process (idempotent)."""
    logger = logging.getLogger(_TORCH_FX_LOGGER)
    if not any(isinstance(f, _DropPrefix) for f in logger.filters):
        logger.addFilter(_DropPrefix(_FX_TRACING_NOTICE))
