"""Where a follower's points go (diffmon.follow): a ``wandb`` Run, accelerate's ``Accelerator``,
Lightning loggers, a function. :func:`sinks_for` picks them for ``diffmon.log_to``'s target;
docs/guide/trackers.md says what each gets."""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable, Optional

__all__ = ["STEP_METRIC", "EARLY_STOP_METRIC", "EARLY_STOP_SUMMARY", "Sink", "WandbSink",
           "LightningSink", "AccelerateSink", "CallbackSink", "sinks_for"]

log = logging.getLogger("diffmon.follow")

# The custom step of W&B runs, the early stop's marker scalar (1 fired, 0 resolved) and its
# sentence: the daemon's TensorBoard writer names the last two the same.
STEP_METRIC = "diffmon/step"
EARLY_STOP_METRIC = "diffmon/early_stop"
EARLY_STOP_SUMMARY = "diffmon/early_stop_summary"


class Sink:
    """Where a follower's points go. ``identity`` names the destination for the process-wide
    record of what was logged; ``active`` is False where this process must not log (not the
    main process)."""

    identity: tuple = ()
    anchors: tuple = ()

    @property
    def active(self) -> bool:
        return True

    def evaluation(self, step: int, metrics: dict, ordinal: int) -> None:
        raise NotImplementedError

    def stop_event(self, event: dict, step: int, fired: bool, key: str, text: str) -> None:
        """An early stop (``fired``) or its resolution: the marker at ``step``; ``text`` is
        the event's sentence, ``key`` its identity (``early_stop:<id>``, ``resolved:<id>``,
        ``withdrawn:<id>``)."""
        self.evaluation(step, {EARLY_STOP_METRIC: 1 if fired else 0}, -1)

    def tick(self) -> None:
        """Called at the end of every poll."""

    def flush(self) -> None:
        """Log whatever waits (at the follower's stop)."""


def _wandb_alert_level(name: str):
    try:
        import wandb

        return getattr(wandb.AlertLevel, name)
    except (ImportError, AttributeError):
        return name


class WandbSink(Sink):
    """A ``wandb`` Run. Every point carries the custom step ``diffmon/step``
    (``define_metric("diffmon/*", step_metric="diffmon/step")``), so that W&B draws it at the
    checkpoint's step whatever its own step is. An early stop (and its resolution) sets the
    run's summary (``diffmon/early_stop``, ``diffmon/early_stop_event``, ``diffmon/best_step``,
    ...) and sends one ``run.alert``.

    ``rows``: ``"own"`` logs each point as a row of its own (``run.log(point)``, which moves
    W&B's step on by one): for a run only diffmon writes (``python -m diffmon.wandb``) or whose
    code never passes ``step=`` to ``run.log``. ``"share"`` (the default of ``log_to`` on a run
    of the training's own) adds one point to each row the training logs (``commit=False``), so
    that a training loop that logs with ``step=global_step`` (accelerate's tracker does) never
    finds W&B's step moved past its own, which would drop its rows; the points wait for the
    training's next row, and :meth:`flush` (the follower's ``stop()``) logs what still waits.

    The summary keeps ``diffmon/evaluations_logged`` (the journal's evaluations logged, in its
    order) and ``diffmon/events_logged``: on a run W&B resumed (``run.resumed``, online only),
    what they name is not logged again. ``resumed`` overrides ``run.resumed``.
    """

    def __init__(self, run: Any, rows: str = "own", resumed: Optional[bool] = None):
        if rows not in ("own", "share"):
            raise ValueError("rows must be 'own' or 'share'")
        self.run = run
        self.rows = rows
        self.pending: collections.deque = collections.deque()  # (point, ordinal), shared rows
        self._row = None  # W&B's step when a shared point was last added
        self.identity = ("wandb", str(getattr(run, "id", None) or id(run)))
        self.anchors = (run,)
        self.skip, self.events_logged = 0, []
        if getattr(run, "resumed", False) if resumed is None else resumed:
            summary = run.summary
            self.skip = int(summary.get("diffmon/evaluations_logged") or 0)
            self.events_logged = list(summary.get("diffmon/events_logged") or [])
            if self.skip or self.events_logged:
                log.info("W&B run %s resumed: %d evaluations and %d early-stop events were "
                         "logged into it before, not again", self.identity[1], self.skip,
                         len(self.events_logged))
        run.define_metric(STEP_METRIC)
        run.define_metric("diffmon/*", step_metric=STEP_METRIC)

    def evaluation(self, step: int, metrics: dict, ordinal: int) -> None:
        if 0 <= ordinal < self.skip:
            return
        point = dict(metrics)
        point[STEP_METRIC] = step
        if self.rows == "own":
            self._log(point, ordinal, commit=True)
        else:
            self.pending.append((point, ordinal))
            self._share()

    def _log(self, point: dict, ordinal: int, commit: bool) -> None:
        self.run.log(point, commit=commit)
        if ordinal >= 0:
            self.run.summary["diffmon/evaluations_logged"] = ordinal + 1

    def _share(self) -> None:
        """Add the oldest waiting point to the training's current row, once per row."""
        if not self.pending:
            return
        now = getattr(self.run, "step", None)
        if self._row is not None and now == self._row:
            return  # the row holding the last point is not logged yet
        self._log(*self.pending.popleft(), commit=False)
        self._row = now

    def tick(self) -> None:
        self._share()

    def stop_event(self, event: dict, step: int, fired: bool, key: str, text: str) -> None:
        if key in self.events_logged:
            return
        self.evaluation(step, {EARLY_STOP_METRIC: 1 if fired else 0}, -1)
        summary = self.run.summary
        summary[EARLY_STOP_METRIC] = 1 if fired else 0
        summary["diffmon/early_stop_event"] = "early_stop" if fired else "resolved"
        for field, name in (("id", "early_stop_id"), ("trigger", "early_stop_trigger"),
                            ("metric", "early_stop_metric"), ("current_step", "early_stop_step"),
                            ("current_value", "early_stop_value"), ("fired_at", "early_stop_at"),
                            ("best_step", "best_step"), ("best_value", "best_value"),
                            ("best_checkpoint", "best_checkpoint"),
                            ("best_checkpoint_kept", "best_checkpoint_kept")):
            if event.get(field) is not None:
                summary[f"diffmon/{name}"] = event[field]
        summary[EARLY_STOP_SUMMARY] = text
        self.events_logged.append(key)
        summary["diffmon/events_logged"] = list(self.events_logged)
        run_name = event.get("run") or "?"
        if fired:
            title, level = f"diffmon: early stop on run {run_name}", "WARN"
        else:
            title, level = f"diffmon: early stop resolved on run {run_name}", "INFO"
        self.run.alert(title=title, text=text, level=_wandb_alert_level(level))

    def flush(self) -> None:
        if self.pending and self._row is not None and getattr(self.run, "step", None) == self._row:
            self.run.log({})  # commits the row holding the last shared point, not to merge into it
        while self.pending:
            self._log(*self.pending.popleft(), commit=True)
        self._row = None


class LightningSink(Sink):
    """Lightning loggers (``trainer.loggers``, or one logger): ``logger.log_metrics(metrics,
    step=step)`` for each; with ``trainer``, only on its global rank zero."""

    def __init__(self, loggers: Any, trainer: Any = None):
        self.loggers = list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]
        self.trainer = trainer
        self.identity = ("lightning",) + tuple(id(lg) for lg in self.loggers)
        self.anchors = tuple(self.loggers)

    @property
    def active(self) -> bool:
        return bool(getattr(self.trainer, "is_global_zero", True))

    def evaluation(self, step: int, metrics: dict, ordinal: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(dict(metrics), step=step)


class AccelerateSink(Sink):
    """accelerate's ``Accelerator``: ``accelerator.log(values, step=step)`` on the main process.
    Its ``wandb`` tracker is the exception: accelerate passes ``step`` to ``run.log``, which W&B
    drops when the training has logged a later step; that run gets the points through a
    :class:`WandbSink` (custom step, shared rows) instead, and the other trackers
    ``tracker.log(values, step=step)``."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.identity = ("accelerate", id(accelerator))
        self.anchors = (accelerator,)
        self._wandb: dict[int, WandbSink] = {}

    @property
    def active(self) -> bool:
        return bool(getattr(self.accelerator, "is_main_process", True))

    def _wandb_sink(self, tracker: Any) -> WandbSink:
        sink = self._wandb.get(id(tracker))
        if sink is None:
            sink = self._wandb[id(tracker)] = WandbSink(tracker.tracker, rows="share")
        return sink

    def _split(self) -> tuple[list, list]:
        trackers = list(getattr(self.accelerator, "trackers", []) or [])
        wandb = [t for t in trackers if getattr(t, "name", None) == "wandb"]
        return wandb, [t for t in trackers if t not in wandb]

    def evaluation(self, step: int, metrics: dict, ordinal: int) -> None:
        wandb, others = self._split()
        if not wandb:
            self.accelerator.log(dict(metrics), step=step)
            return
        for tracker in wandb:
            self._wandb_sink(tracker).evaluation(step, metrics, ordinal)
        for tracker in others:
            tracker.log(dict(metrics), step=step)

    def stop_event(self, event: dict, step: int, fired: bool, key: str, text: str) -> None:
        wandb, others = self._split()
        if not wandb:
            return super().stop_event(event, step, fired, key, text)
        for tracker in wandb:
            self._wandb_sink(tracker).stop_event(event, step, fired, key, text)
        for tracker in others:
            tracker.log({EARLY_STOP_METRIC: 1 if fired else 0}, step=step)

    def tick(self) -> None:
        for sink in self._wandb.values():
            sink.tick()

    def flush(self) -> None:
        for sink in self._wandb.values():
            sink.flush()


class CallbackSink(Sink):
    """A function ``fn(metrics, step)``: anything else."""

    def __init__(self, fn: Callable[[dict, int], Any]):
        self.fn = fn
        self.identity = ("callable", id(fn))
        self.anchors = (fn,)

    def evaluation(self, step: int, metrics: dict, ordinal: int) -> None:
        self.fn(dict(metrics), step)


def _is_wandb_run(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("define_metric", "log", "summary", "alert"))


def sinks_for(target: Any, wandb_rows: str = "share") -> list[Sink]:
    """The sinks of a target: a ``wandb`` Run, a Lightning logger or ``Trainer``, an
    ``Accelerator``, a function ``fn(metrics, step)``, a :class:`Sink`, or a list of them."""
    if isinstance(target, Sink):
        return [target]
    if isinstance(target, (list, tuple)):
        return [s for t in target for s in sinks_for(t, wandb_rows)]
    if _is_wandb_run(target):
        return [WandbSink(target, rows=wandb_rows)]
    if hasattr(target, "init_trackers") and hasattr(target, "log"):
        return [AccelerateSink(target)]
    if hasattr(target, "loggers") and hasattr(target, "is_global_zero"):
        return [LightningSink(target.loggers, target)]
    if hasattr(target, "log_metrics"):
        return [LightningSink(target)]
    if callable(target):
        return [CallbackSink(target)]
    raise TypeError(f"diffmon.log_to: cannot log into {type(target).__name__}: pass a wandb Run, "
                    "a Lightning logger or Trainer, an accelerate Accelerator or a function "
                    "fn(metrics, step)")
