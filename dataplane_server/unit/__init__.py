"""The storage unit actor: the Ray shell around ``core.unit.store.UnitStore``."""
