"""Python helpers for diffmon: export a network to the model contract, obey the early stop, log
diffmon's evaluations into an experiment tracker.

    from diffmon import export, export_vae, should_stop, read_stop_event, DiffmonEarlyStopping
    from diffmon import log_to, Follower, METRICS   # W&B, Lightning loggers, accelerate

`python -m diffmon.wandb` follows the daemon into a W&B run of its own (diffmon/wandb.py).
"""

import sys as _sys

from .follow import METRICS, Follower, log_to
from .stop import DEFAULT_STOP_FILE, DiffmonEarlyStopping, read_stop_event, should_stop

__all__ = ["export", "export_vae", "ExportError", "should_stop", "read_stop_event", "DiffmonEarlyStopping",
           "DEFAULT_STOP_FILE", "log_to", "Follower", "METRICS"]
__version__ = "0.1.0"

if _sys.argv[:1] == ["-m"]:
    # `python -m diffmon.export` is being located: importing the submodule here would make runpy
    # warn that it is already imported. Resolve the names on first use instead.
    def __getattr__(name):
        if name in ("export", "export_vae", "ExportError"):
            from . import export as _module

            globals().update(export=_module.export, export_vae=_module.export_vae,
                             ExportError=_module.ExportError)
            return globals()[name]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
else:
    from .export import ExportError, export, export_vae
