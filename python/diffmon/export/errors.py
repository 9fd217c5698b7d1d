"""The exporter's one error: what failed, said in one line (``diffmon-export: error: ...``)."""

from __future__ import annotations




class ExportError(RuntimeError):
    """The module cannot be exported, or the exported file does not reproduce it."""
