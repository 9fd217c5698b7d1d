"""Follow the daemon's evaluations and log them into an experiment tracker, in the training process.

The daemon journals every evaluation in ``<state_dir>/history.jsonl`` (docs/design.md §13; the
state folder defaults to ``<run_dir>/.diffmon``) and writes its early stop into
``<run_dir>/EARLY_STOP`` (§17). A :class:`Follower` reads both, only what is new at each
:meth:`Follower.poll`, and hands each evaluation and each early-stop event to the targets::

    import diffmon
    follower = diffmon.log_to(wandb_run, run_dir)   # or a Lightning logger, or an Accelerator
    for step, batch in enumerate(loader):
        ...
        follower.poll()                             # logs whatever the daemon evaluated since
    follower.stop()                                 # a last poll, then whatever waits is logged

``log_to(..., background=5.0)`` polls from a thread every 5 s instead (for a W&B run or an
Accelerator; a Lightning logger is better polled from the training loop, or by
``DiffmonEarlyStopping(run_dir, log_evaluations=True)``).

What the targets get (:data:`METRICS` is the one table of names; the daemon's TensorBoard
writer uses the same tags): one point per evaluation at the checkpoint's training step, one
scalar ``diffmon/<name>`` per metric the record holds (absent ones are skipped, never zero),
and for an early stop the marker ``diffmon/early_stop`` = 1 at the event's ``current_step``
(0 when it is resolved). A W&B run also gets the custom step ``diffmon/step`` (W&B's own step
only grows, and a checkpoint is evaluated after later training steps were logged), the event's
fields in its summary and one alert per event; see docs/guide/trackers.md.

The folders are read as if someone else wrote them: nothing is written there, nothing is
followed or run; at most ``max_bytes`` of the journal are read per poll (from the offset where
the last poll stopped); a torn last line waits until it is complete; a line that is not an
entry is skipped with a warning naming the file and the line. Nothing is logged twice for the
life of the process: a new follower of the same target and state folder skips what an earlier
one logged, and a journal the daemon rewrote (it drops garbage and a torn line at its start)
is read again from its start without logging its evaluations again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import stat
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from .sinks import (EARLY_STOP_METRIC, STEP_METRIC, AccelerateSink, CallbackSink,  # noqa: F401
                    LightningSink, Sink, WandbSink, sinks_for)
from .stop import DEFAULT_STOP_FILE, describe_event

__all__ = ["METRICS", "STEP_METRIC", "EARLY_STOP_METRIC", "Follower", "log_to", "metrics_of",
           "WandbSink", "LightningSink", "AccelerateSink", "CallbackSink", "sinks_for"]

log = logging.getLogger("diffmon.follow")

PathLike = Union[str, "os.PathLike[str]"]

# The record's field (docs/design.md §13, "Record") -> its tag. The daemon's TensorBoard writer
# (src/trackers/tensorboard.rs) writes `diffmon/<field>` for the record's scalar fields
# (src/record.rs, FIELDS), `diffmon/<metric>_smoothed` and `diffmon/evaluation_seconds`: the
# same names here. The `*_smoothed` fields are logged when the record has them.
METRICS: tuple[tuple[str, str], ...] = (
    ("icr", "diffmon/icr"),
    ("icr_smoothed", "diffmon/icr_smoothed"),
    ("icr_stderr", "diffmon/icr_stderr"),
    ("icr_samples", "diffmon/icr_samples"),
    ("icr_invariant_trace", "diffmon/icr_invariant_trace"),
    ("icr_residual_trace", "diffmon/icr_residual_trace"),
    ("icr_invariant_trace_normalized", "diffmon/icr_invariant_trace_normalized"),
    ("icr_residual_trace_normalized", "diffmon/icr_residual_trace_normalized"),
    ("pfd_generalization", "diffmon/pfd_generalization"),
    ("pfd_generalization_smoothed", "diffmon/pfd_generalization_smoothed"),
    ("pfd_memorization", "diffmon/pfd_memorization"),
    ("memorization_ratio", "diffmon/memorization_ratio"),
    ("generalization_gap", "diffmon/generalization_gap"),
    ("generalization_gap_stderr", "diffmon/generalization_gap_stderr"),
    ("tail_rmsqe", "diffmon/tail_rmsqe"),
    ("tail_loader", "diffmon/tail_loader"),
    ("loss_train", "diffmon/loss_train"),
    ("loss_heldout", "diffmon/loss_heldout"),
    ("gpu_seconds", "diffmon/gpu_seconds"),
    ("gpu_memory_peak_bytes", "diffmon/gpu_memory_peak_bytes"),
    ("seconds", "diffmon/evaluation_seconds"),
)
DEFAULT_MAX_BYTES = 8 << 20
MAX_STOP_FILE_BYTES = 1 << 20
MAX_WARNINGS_PER_POLL = 10
_TAIL = 64  # bytes before the offset, checked at each poll: a journal rewritten in place


def metrics_of(record: dict) -> dict[str, float]:
    """The tags and values of one evaluation record: finite numbers only, absent ones skipped."""
    out = {}
    for field, tag in METRICS:
        v = record.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[tag] = v
    return out


# ---------------------------------------------------------------------------------------------
# Reading the journal
# ---------------------------------------------------------------------------------------------

def _open_regular(path: Path) -> Optional[int]:
    """A read-only descriptor of a regular file at ``path`` (never through a link, never
    blocking on a FIFO), None when absent; OSError(ELOOP/...) or ValueError when it is not one."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError("not a regular file")
    return fd


class Journal:
    """Reads the complete new lines of ``history.jsonl``, at most ``max_bytes`` per call."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1024:
            raise ValueError("max_bytes must be at least 1024")
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self.offset = 0
        self.line = 0            # lines consumed so far (the next one is line + 1)
        self.identity = None     # (st_dev, st_ino) of the file followed
        self.tail = b""          # the bytes just before `offset`
        self.skipping = False    # inside an over-long line, skipped to its end
        self.caught_up = False   # the last read reached the end of the file
        self._said = None

    def _say(self, message: str) -> None:
        if message != self._said:
            log.warning("%s", message)
            self._said = message

    def read(self) -> list[tuple[int, bytes]]:
        """The complete lines read now, as (line number, bytes), blank ones included."""
        try:
            fd = _open_regular(self.path)
        except (OSError, ValueError) as e:
            self._say(f"{self.path}: not read ({e}): the journal must be a regular file")
            self.caught_up = True
            return []
        if fd is None:
            self.caught_up = True
            return []
        self._said = None
        try:
            st = os.fstat(fd)
            identity = (st.st_dev, st.st_ino)
            if self.identity is not None and (identity != self.identity or st.st_size < self.offset
                                              or not self._tail_matches(fd)):
                log.info("%s was rewritten (the daemon drops garbage and a torn line when it "
                         "starts): reading it again from its start; nothing is logged twice",
                         self.path)
                self.offset, self.line, self.tail, self.skipping = 0, 0, b"", False
            self.identity = identity
            chunk = os.pread(fd, self.max_bytes, self.offset)
            self.caught_up = self.offset + len(chunk) >= st.st_size
        finally:
            os.close(fd)
        return self._lines(chunk)

    def _tail_matches(self, fd: int) -> bool:
        if not self.tail:
            return True
        return os.pread(fd, len(self.tail), self.offset - len(self.tail)) == self.tail

    def _lines(self, chunk: bytes) -> list[tuple[int, bytes]]:
        out = []
        start = 0
        if self.skipping:
            end = chunk.find(b"\n")
            if end < 0:
                self._advance(chunk, len(chunk))
                return out
            start = end + 1
            self.skipping = False
            self.line += 1
        last = chunk.rfind(b"\n")
        if last < start:
            if start == 0 and len(chunk) >= self.max_bytes:
                # A line longer than a whole read: it would never complete within the bound.
                log.warning("%s, line %d: longer than %d bytes, skipped", self.path,
                            self.line + 1, self.max_bytes)
                self.skipping = True
                self._advance(chunk, len(chunk))
            elif start:
                self._advance(chunk, start)
            return out  # else a torn last line: it waits until it is complete
        for raw in chunk[start:last].split(b"\n"):
            self.line += 1
            out.append((self.line, raw))
        self._advance(chunk, last + 1)
        return out

    def _advance(self, chunk: bytes, n: int) -> None:
        self.offset += n
        self.tail = (self.tail + chunk[:n])[-_TAIL:]


def _key(entry: dict) -> Optional[str]:
    """An evaluation's identity: its checkpoint key ``{path, size, mtime_ns}`` (§13)."""
    key = entry.get("key")
    if isinstance(key, dict) and key:
        return json.dumps(key, sort_keys=True, separators=(",", ":"))
    record = entry["record"]
    return json.dumps([entry.get("at"), record.get("step"), record.get("checkpoint")])


def _parse(raw: bytes) -> Optional[dict]:
    """The entry of one journal line, or None when the line is not one (garbage)."""
    try:
        entry = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("kind"), str):
        return None
    if entry["kind"] == "evaluation":
        record = entry.get("record")
        if not isinstance(record, dict):
            return None
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return None
    return entry


# ---------------------------------------------------------------------------------------------
# What was logged, for the life of the process
# ---------------------------------------------------------------------------------------------

class _Progress:
    """What was logged into one target from one state folder."""

    def __init__(self) -> None:
        self.keys: set[str] = set()      # evaluations logged (their checkpoint keys)
        self.events: set[str] = set()    # early-stop events logged ("early_stop:<id>", ...)
        self.active: Optional[dict] = None  # the early stop last seen in the stop file


_PROGRESS: dict[tuple, _Progress] = {}
_PROGRESS_LOCK = threading.Lock()


def _progress_for(identity: tuple, anchors: Iterable[Any]) -> _Progress:
    with _PROGRESS_LOCK:
        progress = _PROGRESS.get(identity)
        if progress is None:
            progress = _PROGRESS[identity] = _Progress()
            for obj in anchors:
                # An identity made of id(obj) is dropped with obj, before another may reuse it.
                try:
                    weakref.finalize(obj, _PROGRESS.pop, identity, None)
                except TypeError:
                    pass
        return progress


# ---------------------------------------------------------------------------------------------
# The follower
# ---------------------------------------------------------------------------------------------

def resolve_dirs(run_dir: Optional[PathLike] = None,
                 state_dir: Optional[PathLike] = None) -> tuple[Optional[Path], Path]:
    """(run folder, state folder). A path that holds ``history.jsonl`` or is named ``.diffmon``
    is a state folder (its parent the run folder when it is ``.diffmon``); else a run folder,
    whose state folder is ``<run_dir>/.diffmon`` unless ``state_dir`` says."""
    if run_dir is None and state_dir is None:
        raise ValueError("give the run folder or the state folder")
    if state_dir is not None:
        return (Path(run_dir) if run_dir is not None else None), Path(state_dir)
    p = Path(run_dir)
    if p.name == ".diffmon":
        return p.parent, p
    if (p / "history.jsonl").exists() and not (p / ".diffmon").exists():
        return None, p
    return p, p / ".diffmon"


class Follower:
    """Reads the daemon's journal and stop file and hands what is new to ``sinks``.

    ``poll()`` logs what is new and returns how many points it logged; ``start(interval)`` polls
    from a background thread until ``stop()``, which polls once more and flushes the sinks.
    """

    def __init__(self, sinks: list[Sink], run_dir: Optional[PathLike] = None,
                 state_dir: Optional[PathLike] = None, stop_file: str = DEFAULT_STOP_FILE,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        self.sinks = list(sinks)
        if not self.sinks:
            raise ValueError("a follower needs at least one target")
        self.run_dir, self.state_dir = resolve_dirs(run_dir, state_dir)
        self.stop_file = stop_file
        self.journal = Journal(self.state_dir / "history.jsonl", max_bytes)
        anchors = [a for s in self.sinks for a in s.anchors]
        where = os.path.realpath(self.state_dir)
        identity = tuple(s.identity for s in self.sinks) + (where,)
        self.progress = _progress_for(identity, anchors)
        self.ordinal = 0          # evaluations of the journal met so far, in journal order
        self.seen: set[str] = set()
        self.segment = 1          # one more after each `resume` entry
        self.last_step: Optional[int] = None
        self.stopped = False      # the stop file stands (as `should_stop` reads it)
        self._thread: Optional[threading.Thread] = None
        self._halt: Optional[threading.Event] = None
        self._lock = threading.Lock()
        self._stop_said = None

    def __getstate__(self):  # deep-copied with a Lightning callback: locks do not copy
        state = dict(self.__dict__)
        state["_lock"] = None
        state["_thread"] = state["_halt"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def caught_up(self) -> bool:
        """The last poll read the journal to its end."""
        return self.journal.caught_up

    def poll(self) -> int:
        """Log what is new in the journal and the stop file; the number of points logged."""
        if not any(s.active for s in self.sinks):
            return 0
        with self._lock:
            n = self._read_journal()
            if self.journal.caught_up:  # the evaluation that fired a stop is journaled first
                n += self._read_stop_file()
            for sink in self.sinks:
                sink.tick()
            return n

    def _read_journal(self) -> int:
        n = 0
        warned = 0
        for number, raw in self.journal.read():
            if not raw.strip():
                continue
            entry = _parse(raw)
            if entry is None:
                warned += 1
                if warned <= MAX_WARNINGS_PER_POLL:
                    log.warning("%s, line %d: not a journal entry, skipped", self.journal.path,
                                number)
                continue
            kind = entry["kind"]
            if kind == "resume":
                self.segment += 1
                continue
            if kind != "evaluation":
                continue  # failures, and kinds of a later daemon
            key = _key(entry)
            if key in self.seen:
                continue  # a duplicate line, or the journal read again after a rewrite
            self.seen.add(key)
            ordinal = self.ordinal
            self.ordinal += 1
            record = entry["record"]
            self.last_step = record["step"]
            if key in self.progress.keys:
                continue
            metrics = metrics_of(record)
            for sink in self.sinks:
                sink.evaluation(record["step"], metrics, ordinal)
            self.progress.keys.add(key)
            n += 1
        if warned > MAX_WARNINGS_PER_POLL:
            log.warning("%s: %d more lines that are not journal entries skipped",
                        self.journal.path, warned - MAX_WARNINGS_PER_POLL)
        return n

    def _stop_event(self) -> tuple[bool, Optional[dict]]:
        """(the stop file exists, its event when it holds a readable one)."""
        if self.run_dir is None:
            return False, None
        path = self.run_dir / self.stop_file
        try:
            fd = _open_regular(path)
        except (OSError, ValueError) as e:
            if self._stop_said != str(e):
                log.warning("%s: not read (%s)", path, e)
                self._stop_said = str(e)
            return True, None
        if fd is None:
            return False, None
        try:
            raw = os.read(fd, MAX_STOP_FILE_BYTES)
        finally:
            os.close(fd)
        try:
            event = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return True, None
        if not isinstance(event, dict) or event.get("event") not in ("early_stop", "resolved"):
            return True, None
        return True, event

    def _emit(self, event: dict, fired: bool, key: str, step: Any, text: str = "") -> int:
        if key in self.progress.events:
            return 0
        if isinstance(step, bool) or not isinstance(step, int):
            step = self.last_step if self.last_step is not None else 0
        text = text or describe_event(event)
        for sink in self.sinks:
            sink.stop_event(event, step, fired, key, text)
        self.progress.events.add(key)
        return 1

    def _read_stop_file(self) -> int:
        exists, event = self._stop_event()
        progress = self.progress
        # As `should_stop` reads it: any stop file stops, but a resolved event.
        self.stopped = exists and not (event is not None and event["event"] == "resolved")
        if event is not None and event["event"] == "early_stop":
            progress.active = event
            return self._emit(event, True, f"early_stop:{event.get('id')}",
                              event.get("current_step"))
        if event is not None:  # a resolved event someone wrote into the stop file
            progress.active = None
            return self._emit(event, False, f"resolved:{event.get('id')}",
                              event.get("current_step"))
        if not exists and progress.active is not None:
            # The daemon removes the stop file when it resolves the stop (§17), and a person may
            # remove it to go on: the stop no longer stands, from the last evaluation's step.
            active, progress.active = progress.active, None
            withdrawn = {k: v for k, v in active.items()
                         if k not in ("current_step", "current_value", "fired_at")}
            withdrawn["event"] = "resolved"
            text = (f"diffmon: the early stop of run {active.get('run')} (event {active.get('id')}, "
                    f"best {active.get('metric', 'metric')} at step {active.get('best_step')}) "
                    f"no longer stands: {self.run_dir / self.stop_file} was removed")
            return self._emit(withdrawn, False, f"withdrawn:{active.get('id')}", self.last_step,
                              text)
        return 0

    # -- background polling ------------------------------------------------------------------

    def start(self, interval: float = 5.0) -> "Follower":
        """Poll every ``interval`` seconds from a daemon thread until :meth:`stop`."""
        if interval <= 0:
            raise ValueError("interval must be positive")
        if self._thread is not None:
            return self
        self._halt = threading.Event()

        def loop(halt: threading.Event) -> None:
            while not halt.wait(interval):
                try:
                    self.poll()
                except Exception:  # noqa: BLE001 - the training must go on
                    log.exception("diffmon: following %s failed; trying again in %s s",
                                  self.state_dir, interval)

        self._thread = threading.Thread(target=loop, args=(self._halt,), daemon=True,
                                        name="diffmon-follow")
        self._thread.start()
        return self

    def stop(self, final_poll: bool = True) -> int:
        """Stop the thread (if any), poll once more, and log what waits; the points logged."""
        if self._thread is not None:
            self._halt.set()
            self._thread.join()
            self._thread = None
        n = self.poll() if final_poll else 0
        with self._lock:
            for sink in self.sinks:
                sink.flush()
        return n

    close = stop

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def log_to(target: Any, run_dir: Optional[PathLike] = None, *, state_dir: Optional[PathLike] = None,
           stop_file: str = DEFAULT_STOP_FILE, background: Optional[float] = None,
           wandb_rows: str = "share", max_bytes: int = DEFAULT_MAX_BYTES) -> Follower:
    """Follow the daemon watching ``run_dir`` (a run folder, or its state folder) and log its
    evaluations and early stop into ``target``: a ``wandb`` Run, a Lightning logger or Trainer,
    an accelerate ``Accelerator``, a function ``fn(metrics, step)``, or a list of them.

    Returns the :class:`Follower`, which has already polled once: call ``poll()`` from the
    training loop (or pass ``background=SECONDS`` to poll from a thread), and ``stop()`` at the
    end, before ``run.finish()``. ``wandb_rows`` is :class:`WandbSink`'s ``rows``.
    """
    follower = Follower(sinks_for(target, wandb_rows), run_dir, state_dir, stop_file, max_bytes)
    follower.poll()
    if background is not None:
        follower.start(background)
    return follower


def stable_run_id(state_dir: PathLike) -> str:
    """A W&B run id derived from the absolute state folder: ``diffmon-<16 hex>``."""
    digest = hashlib.sha256(os.path.abspath(state_dir).encode("utf-8", "surrogateescape"))
    return "diffmon-" + digest.hexdigest()[:16]
