"""Obey diffmon's early-stop signal from a training loop (docs/design.md §17).

When diffmon detects the turn of the ICR curve it writes ``<run_dir>/<stop_file>`` (default
``EARLY_STOP``) atomically, holding the event JSON::

    {"id", "event", "run", "metric", "trigger", "best_step", "best_checkpoint",
     "best_checkpoint_kept", "best_value", "current_step", "current_value", "fired_at"}

``trigger`` is ``"turn"`` (the curve turned up, confirmed) or ``"memorization"`` (the
memorization ratio reached ``early_stop.memorization_level`` first; the best is the best
checkpoint evaluated before that).

``best_checkpoint_kept`` is diffmon's copy of the best checkpoint in its state folder (safe from
the training job's checkpoint rotation), or null: then the original is the only copy.
``describe_event`` (and the Lightning callback's message) names both.

Plain loop::

    from diffmon import should_stop
    if step % ckpt_every == 0:
        save_checkpoint(...)
        if should_stop(run_dir):
            break

PyTorch Lightning::

    trainer = L.Trainer(callbacks=[DiffmonEarlyStopping(run_dir)])
    # ... and diffmon's evaluations into the trainer's loggers, at the checkpoints' steps:
    trainer = L.Trainer(callbacks=[DiffmonEarlyStopping(run_dir, log_evaluations=True)])

Lightning is imported only when the callback is created, so this module works without it.

An existing stop file means "stop", whatever it holds (a person may also ``touch`` it), except a
well-formed event whose ``event`` is ``"resolved"``, which withdraws an earlier stop.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Union

__all__ = ["DEFAULT_STOP_FILE", "stop_file_path", "should_stop", "read_stop_event",
           "DiffmonEarlyStopping"]

DEFAULT_STOP_FILE = "EARLY_STOP"
PathLike = Union[str, "os.PathLike[str]"]


def stop_file_path(run_dir: PathLike, stop_file: str = DEFAULT_STOP_FILE) -> Path:
    """``<run_dir>/<stop_file>`` (an absolute ``stop_file`` is used as is)."""
    return Path(run_dir) / stop_file


def _read(path: Path) -> tuple[bool, Optional[dict]]:
    """(exists, parsed event or None)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return False, None
    except IsADirectoryError:
        return True, None
    except OSError:
        # Exists but unreadable (permissions, NFS hiccup): treat as a stop without an event.
        return path.exists(), None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return True, None
    return True, obj if isinstance(obj, dict) else None


def read_stop_event(run_dir: PathLike, stop_file: str = DEFAULT_STOP_FILE) -> Optional[dict]:
    """The event JSON held by the stop file, or None when the file is absent, empty or garbled."""
    return _read(stop_file_path(run_dir, stop_file))[1]


def should_stop(run_dir: PathLike, stop_file: str = DEFAULT_STOP_FILE) -> bool:
    """True when the stop file exists (even when its content is partial or not JSON), unless it
    holds a well-formed ``"resolved"`` event."""
    exists, event = _read(stop_file_path(run_dir, stop_file))
    if not exists:
        return False
    return not (event is not None and event.get("event") == "resolved")


NOT_KEPT = "not kept: the original is the only copy"


def _best_checkpoint(event: dict) -> str:
    """The best checkpoint and its kept copy, as diffmon's own messages name them:
    ``<checkpoint> (kept as <copy>)``, or that the original is the only copy. An event without
    the field (from a diffmon before it) names the checkpoint alone."""
    checkpoint = event.get("best_checkpoint")
    if "best_checkpoint_kept" not in event:
        return f"{checkpoint}"
    kept = event.get("best_checkpoint_kept")
    return f"{checkpoint} (kept as {kept})" if kept else f"{checkpoint} ({NOT_KEPT})"


def describe_event(event: Optional[dict]) -> str:
    """One human-readable line about a stop event, naming the best checkpoint's kept copy."""
    if not event:
        return "diffmon early-stop file present (no readable event)"
    why = (" (the memorization ratio reached its stop level)"
           if event.get("trigger") == "memorization" else "")
    return (f"diffmon {event.get('event', 'early_stop')} on run {event.get('run')!s}{why}: "
            f"best {event.get('metric', 'metric')} = {_value(event.get('best_value'))} at step "
            f"{event.get('best_step')}: {_best_checkpoint(event)}; now "
            f"{_value(event.get('current_value'))} at step {event.get('current_step')}")


def _value(v) -> str:
    """A value as the daemon's messages write it: at most 6 decimals, trailing zeros dropped;
    very small or large ones in exponent form (``1.2346e-4``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        mantissa, exponent = f"{v:.4e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{v:.6f}".rstrip("0").rstrip(".")


# ---------------------------------------------------------------------------------------------
# PyTorch Lightning callback (lazy)
# ---------------------------------------------------------------------------------------------

_LIGHTNING_HINT = ("DiffmonEarlyStopping needs PyTorch Lightning (`pip install lightning` or "
                   "`pip install pytorch-lightning`); without it, call diffmon.should_stop(run_dir) "
                   "from the training loop instead")


def _lightning_callback_base() -> type:
    errors = []
    for mod_name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            mod = __import__(mod_name, fromlist=["Callback"])
            return mod.Callback
        except ImportError as e:
            errors.append(f"{mod_name}: {e}")
        except AttributeError as e:  # pragma: no cover - broken install
            errors.append(f"{mod_name}: {e}")
    raise ImportError(_LIGHTNING_HINT + " (" + "; ".join(errors) + ")")


_CONCRETE: dict = {}


def _concrete_class(cls: type) -> type:
    base = _lightning_callback_base()
    if issubclass(cls, base):
        return cls
    key = (cls, base)
    if key not in _CONCRETE:
        name = cls.__name__
        concrete = type(name, (cls, base), {"__module__": cls.__module__,
                                            "__qualname__": f"_lightning_{name}"})
        # Make the generated class findable by pickle (e.g. when Lightning deep-copies callbacks).
        if cls.__module__ == __name__:
            setattr(sys.modules[__name__], f"_lightning_{name}", concrete)
        _CONCRETE[key] = concrete
    return _CONCRETE[key]


class DiffmonEarlyStopping:
    """Lightning callback: ``trainer.should_stop = True`` once diffmon's stop file appears.

    Checked at the end of every ``every_n_batches``-th training batch and at the end of each
    validation run. In distributed training the decision is shared across ranks (any rank that
    sees the file stops them all) when the trainer's strategy offers ``reduce_boolean_decision``.

    ``log_evaluations=True`` also logs diffmon's evaluations and its early stop into the
    trainer's loggers (``trainer.loggers``: TensorBoard, CSV, W&B, MLflow...) at each check and
    at the end of training, on global rank zero: ``logger.log_metrics({"diffmon/icr": ...},
    step=<the checkpoint's step>)``, read from the daemon's journal (``<run_dir>/.diffmon``, or
    ``state_dir``) by a :class:`diffmon.follow.Follower`; the names are
    ``diffmon.follow.METRICS``'s.

    Creating an instance without Lightning installed raises ImportError. The created object is an
    instance of both this class and Lightning's ``Callback``.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(_concrete_class(cls))

    def __init__(self, run_dir: PathLike, stop_file: str = DEFAULT_STOP_FILE,
                 every_n_batches: int = 1, check_on_validation_end: bool = True,
                 verbose: bool = True, log_evaluations: bool = False,
                 state_dir: Optional[PathLike] = None):
        super().__init__()
        if every_n_batches < 1:
            raise ValueError("every_n_batches must be >= 1")
        self.run_dir = Path(run_dir)
        self.stop_file = stop_file
        self.every_n_batches = int(every_n_batches)
        self.check_on_validation_end = bool(check_on_validation_end)
        self.verbose = verbose
        self.event: Optional[dict] = None
        self.stopped = False
        self.log_evaluations = bool(log_evaluations)
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.follower = None  # made at the first check, with the trainer's loggers

    def _log(self, trainer: Any, final: bool = False) -> None:
        """Log what the daemon evaluated since the last check into the trainer's loggers."""
        if not self.log_evaluations or not getattr(trainer, "is_global_zero", True):
            return
        if self.follower is None:
            loggers = list(getattr(trainer, "loggers", None) or [])
            if not loggers:
                return
            from .follow import Follower, LightningSink

            self.follower = Follower([LightningSink(loggers)], self.run_dir, self.state_dir,
                                     self.stop_file)
        if final:
            self.follower.stop()
        else:
            self.follower.poll()

    def _check(self, trainer: Any) -> bool:
        self._log(trainer)
        decision = should_stop(self.run_dir, self.stop_file)
        strategy = getattr(trainer, "strategy", None)
        reduce = getattr(strategy, "reduce_boolean_decision", None)
        if callable(reduce):
            try:
                decision = bool(reduce(decision, all=False))
            except TypeError:
                decision = bool(reduce(decision))
        if decision:
            trainer.should_stop = True
            if not self.stopped:
                self.stopped = True
                self.event = read_stop_event(self.run_dir, self.stop_file)
                if self.verbose and getattr(trainer, "is_global_zero", True):
                    print(f"{describe_event(self.event)}; stopping training", flush=True)
        return decision

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int, *args: Any) -> None:
        if (batch_idx + 1) % self.every_n_batches == 0:
            self._check(trainer)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.check_on_validation_end and not getattr(trainer, "sanity_checking", False):
            self._check(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer, final=True)
