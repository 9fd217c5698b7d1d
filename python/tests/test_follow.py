"""diffmon.follow: the journal and stop file read as the daemon writes them, bounded and hostile
input, nothing logged twice; the points into a real accelerate Accelerator (its TensorBoard
tracker, read back by TensorBoard's own reader, and a tracker of accelerate's API) and into a
real Lightning CSVLogger through DiffmonEarlyStopping during Trainer.fit."""

import csv
import logging
import os
import threading
import time

import pytest

import diffmon
from diffmon import follow
from diffmon.follow import METRICS, Follower, log_to, metrics_of
from journal_util import (append, evaluation, failure, record, resume, rewrite, stop_event,
                          write_stop)

# The tags the daemon's TensorBoard writer uses for these fields (issue 61): the same here.
TAGS = {"icr": "diffmon/icr", "icr_smoothed": "diffmon/icr_smoothed",
        "icr_stderr": "diffmon/icr_stderr", "pfd_generalization": "diffmon/pfd_generalization",
        "pfd_memorization": "diffmon/pfd_memorization",
        "memorization_ratio": "diffmon/memorization_ratio",
        "generalization_gap": "diffmon/generalization_gap", "tail_rmsqe": "diffmon/tail_rmsqe",
        "tail_loader": "diffmon/tail_loader", "loss_train": "diffmon/loss_train",
        "loss_heldout": "diffmon/loss_heldout", "seconds": "diffmon/evaluation_seconds"}


class Points:
    """A target that keeps what it is given: ``fn(metrics, step)``."""

    def __init__(self):
        self.rows = []

    def __call__(self, metrics, step):
        self.rows.append((step, metrics))

    def steps(self, tag="diffmon/icr"):
        return [s for s, m in self.rows if tag in m]


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "runs" / "exp1"
    d.mkdir(parents=True)
    return d


def test_the_names_are_the_tensorboard_writers_and_absent_fields_are_skipped():
    mapping = dict(METRICS)
    for field, tag in TAGS.items():
        assert mapping[field] == tag
    assert len(set(mapping.values())) == len(METRICS)
    assert all(tag.startswith("diffmon/") for tag in mapping.values())
    r = record(100, icr_smoothed=0.75, pfd_generalization=0.5, tail_rmsqe=1.25, tail_loader=0.5)
    got = metrics_of(r)
    assert got["diffmon/icr"] == r["icr"] and got["diffmon/icr_smoothed"] == 0.75
    assert got["diffmon/pfd_generalization"] == 0.5 and got["diffmon/evaluation_seconds"] == 1.5
    assert got["diffmon/icr_samples"] == 2048 and got["diffmon/tail_loader"] == 0.5
    # Lists, strings, booleans, nulls and non-finite numbers are not scalars of the record.
    assert not any(k.endswith(("eigenvalues", "sweep", "checkpoint", "step")) for k in got)
    bare = metrics_of({"step": 5, "icr": None, "loss_train": True, "seconds": float("nan"),
                       "pfd_memorization": 0.25})
    assert bare == {"diffmon/pfd_memorization": 0.25}


def test_each_evaluation_is_logged_once_at_its_step(run_dir):
    state = run_dir / ".diffmon"
    append(state, evaluation(100), failure(150), evaluation(200))
    points = Points()
    follower = log_to(points, run_dir)  # polls once at once
    assert points.steps() == [100, 200]
    assert points.rows[0][1] == metrics_of(record(100))
    assert follower.poll() == 0 and len(points.rows) == 2
    append(state, evaluation(300))
    assert follower.poll() == 1 and points.steps() == [100, 200, 300]
    # A duplicate line (the daemon drops them at its next start) is not logged again.
    append(state, evaluation(300))
    assert follower.poll() == 0
    # A new follower of the same target, the state folder given itself: nothing twice.
    assert log_to(points, state).poll() == 0 and len(points.rows) == 3
    # Another target gets the whole history.
    other = Points()
    log_to(other, run_dir)
    assert other.steps() == [100, 200, 300]


def test_a_torn_last_line_waits_until_it_is_complete(run_dir):
    state = run_dir / ".diffmon"
    whole = follow.json.dumps(evaluation(200), separators=(",", ":")).encode() + b"\n"
    append(state, evaluation(100), raw=whole[:40])
    points = Points()
    follower = log_to(points, run_dir)
    assert points.steps() == [100]
    assert follower.poll() == 0
    append(state, raw=whole[40:])
    assert follower.poll() == 1 and points.steps() == [100, 200]


def test_garbage_lines_are_skipped_with_a_warning_naming_the_file_and_line(run_dir, caplog):
    state = run_dir / ".diffmon"
    path = append(state, evaluation(100), raw=b"not json\n\n[1, 2]\n"
                  b'{"kind": "evaluation", "record": {"step": "7"}}\n\xff\xfe\n')
    append(state, evaluation(200), {"kind": "a later daemon's entry", "x": 1})
    points = Points()
    with caplog.at_level(logging.WARNING, logger="diffmon.follow"):
        log_to(points, run_dir)
    assert points.steps() == [100, 200]
    said = [r.getMessage() for r in caplog.records]
    for n in (2, 4, 5, 6):
        assert f"{path}, line {n}: not a journal entry, skipped" in said, said
    assert not any("line 3:" in s or "line 8:" in s for s in said)  # blank, later kind


def test_reads_are_bounded_and_an_overlong_line_is_skipped(run_dir, caplog):
    state = run_dir / ".diffmon"
    append(state, *[evaluation(s) for s in range(10, 310, 10)])
    size = (state / "history.jsonl").stat().st_size
    write_stop(run_dir, stop_event(current_step=300))
    points = Points()
    follower = Follower(follow.sinks_for(points), run_dir, max_bytes=4096)
    reads = 0
    while True:
        before = follower.journal.offset
        follower.poll()
        reads += 1
        assert follower.journal.offset - before <= 4096
        if follower.caught_up:
            break
    assert reads >= size // 4096 and points.steps() == list(range(10, 310, 10))
    # The stop file is read once the journal is caught up: after the evaluation that fired it.
    assert points.rows[-1] == (300, {"diffmon/early_stop": 1}) and len(points.rows) == 31
    # A line longer than one read would never complete within the bound: skipped, and the
    # lines after it are read.
    append(state, raw=b'{"kind": "evaluation", "junk": "' + b"x" * 10000 + b'"}\n')
    append(state, evaluation(400))
    with caplog.at_level(logging.WARNING, logger="diffmon.follow"):
        for _ in range(5):
            follower.poll()
    assert points.steps()[-1] == 400 and len(points.rows) == 32
    assert any("line 31: longer than 4096 bytes, skipped" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError):
        Follower(follow.sinks_for(Points()), run_dir, max_bytes=10)


def test_a_resumed_segment_is_logged_at_its_lower_steps(run_dir):
    state = run_dir / ".diffmon"
    append(state, evaluation(100), evaluation(200), evaluation(300), resume(100),
           evaluation(200, path="/data/runs/exp1/ckpt_000200.pt.2"), evaluation(300, path="/x/3"))
    points = Points()
    follower = log_to(points, run_dir)
    assert points.steps() == [100, 200, 300, 200, 300]
    assert follower.segment == 2


def test_a_journal_rewritten_at_the_daemons_start_is_read_again_without_twice(run_dir):
    state = run_dir / ".diffmon"
    append(state, evaluation(100), raw=b"garbage\n")
    append(state, evaluation(200))
    points = Points()
    follower = log_to(points, run_dir)
    assert points.steps() == [100, 200]
    # The daemon moves the garbage aside and writes the journal anew (shorter), then appends.
    rewrite(state, evaluation(100), evaluation(200))
    append(state, evaluation(300))
    assert follower.poll() == 1 and points.steps() == [100, 200, 300]
    # Rewritten in place (the same file, as long or longer): the bytes before the offset changed.
    (state / "history.jsonl").write_bytes(b"".join(
        follow.json.dumps(e, separators=(",", ":")).encode() + b"\n"
        for e in (evaluation(100), evaluation(250), evaluation(260), evaluation(270))))
    assert follower.poll() == 3 and points.steps() == [100, 200, 300, 250, 260, 270]


def test_the_early_stop_and_its_resolution_are_logged_once(run_dir):
    state = run_dir / ".diffmon"
    append(state, evaluation(100), evaluation(200), evaluation(300))
    points = Points()
    follower = log_to(points, run_dir)
    assert not follower.stopped
    write_stop(run_dir, stop_event(current_step=300))
    assert follower.poll() == 1 and follower.stopped
    assert points.rows[-1] == (300, {"diffmon/early_stop": 1})
    assert follower.poll() == 0 and log_to(points, run_dir).poll() == 0  # once per event id
    # The daemon removes the file when the stop resolves: withdrawn at the last evaluation.
    append(state, evaluation(400))
    os.unlink(run_dir / "EARLY_STOP")
    follower.poll()
    assert points.rows[-2:] == [(400, metrics_of(record(400))), (400, {"diffmon/early_stop": 0})]
    assert not follower.stopped and follower.poll() == 0
    # A resolved event in the file is logged at its step; a second stop of another id too.
    write_stop(run_dir, stop_event("resolved", current_step=450, id="ab" * 32))
    assert follower.poll() == 1 and points.rows[-1] == (450, {"diffmon/early_stop": 0})
    write_stop(run_dir, stop_event(current_step=500, id="cd" * 32))
    assert follower.poll() == 1 and points.rows[-1] == (500, {"diffmon/early_stop": 1})
    # A touched, empty stop file stops (as should_stop reads it) but has no event to log.
    os.unlink(run_dir / "EARLY_STOP")
    follower.poll()
    (run_dir / "EARLY_STOP").write_text("")
    n = len(points.rows)
    assert follower.poll() == 0 and follower.stopped and len(points.rows) == n


def test_links_and_fifos_are_not_followed(run_dir, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere.jsonl"
    append(tmp_path / "x", evaluation(100))
    os.replace(tmp_path / "x" / "history.jsonl", elsewhere)
    (run_dir / ".diffmon").mkdir()
    os.symlink(elsewhere, run_dir / ".diffmon" / "history.jsonl")
    os.mkfifo(run_dir / "EARLY_STOP")  # opening it for reading would block without O_NONBLOCK
    points = Points()
    with caplog.at_level(logging.WARNING, logger="diffmon.follow"):
        follower = log_to(points, run_dir)
        follower.poll()
    assert points.rows == []
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "history.jsonl: not read" in said and "EARLY_STOP: not read" in said


def test_background_polling_and_stop(run_dir):
    state = run_dir / ".diffmon"
    points = Points()
    follower = log_to(points, run_dir, background=0.05)
    assert isinstance(follower._thread, threading.Thread)
    append(state, evaluation(100), evaluation(200))
    deadline = time.monotonic() + 10
    while len(points.rows) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    append(state, evaluation(300))
    follower.stop()  # stops the thread, then a last poll
    assert points.steps() == [100, 200, 300] and follower._thread is None


def test_what_cannot_be_followed_is_a_clear_error(run_dir):
    with pytest.raises(TypeError, match="pass a wandb Run, a Lightning logger"):
        log_to(object(), run_dir)
    with pytest.raises(ValueError):
        Follower([], run_dir)
    assert diffmon.log_to is log_to and diffmon.METRICS is METRICS


# ---------------------------------------------------------------------------------------------
# accelerate
# ---------------------------------------------------------------------------------------------

def test_accelerator_log_gets_every_point_at_its_step(run_dir, tmp_path):
    from accelerate import Accelerator
    from accelerate.tracking import GeneralTracker
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Kept(GeneralTracker):
        """A tracker of accelerate's API that keeps what accelerator.log gives it."""
        name = "kept"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.rows = []

        @property
        def tracker(self):
            return self.rows

        def log(self, values, step=None, **kwargs):
            self.rows.append((step, dict(values)))

    kept = Kept()
    accelerator = Accelerator(cpu=True, log_with=["tensorboard", kept], project_dir=str(tmp_path / "tb"))
    accelerator.init_trackers("exp1")
    state = run_dir / ".diffmon"
    append(state, evaluation(100), evaluation(200))
    follower = log_to(accelerator, run_dir)
    append(state, resume(100), evaluation(150, path="/x/150"))
    write_stop(run_dir, stop_event(current_step=150))
    follower.poll()
    follower.stop()
    log_to(accelerator, run_dir).poll()  # a restarted follower logs nothing twice
    accelerator.end_training()
    expected = [(s, metrics_of(record(s))) for s in (100, 200, 150)] + [(150, {"diffmon/early_stop": 1})]
    assert kept.rows == expected
    # The real TensorBoard tracker's event files, read back by TensorBoard itself.
    (logdir,) = [p for p, _, files in os.walk(tmp_path / "tb") if any("tfevents" in f for f in files)]
    acc = EventAccumulator(logdir)
    acc.Reload()
    icr = [(e.step, round(e.value, 6)) for e in acc.Scalars("diffmon/icr")]
    assert icr == [(s, round(record(s)["icr"], 6)) for s in (100, 200, 150)]
    assert [(e.step, e.value) for e in acc.Scalars("diffmon/early_stop")] == [(150, 1.0)]
    for tag in ("diffmon/evaluation_seconds", "diffmon/generalization_gap", "diffmon/loss_heldout"):
        assert len(acc.Scalars(tag)) == 3


# ---------------------------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The `srun` command", "ignore:.*LeafSpec")
def test_lightning_callback_logs_into_the_trainers_logger_during_fit(run_dir, tmp_path):
    import torch
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.loggers import CSVLogger
    except ImportError:
        import pytorch_lightning as pl
        from pytorch_lightning.loggers import CSVLogger

    state = run_dir / ".diffmon"
    append(state, evaluation(100))

    class Tiny(pl.LightningModule):
        """Stands in for the training; the daemon's writes come at batches 3 and 5."""

        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                append(state, evaluation(200), resume(100), evaluation(150, path="/x/150"))
            if batch_idx == 5:
                write_stop(run_dir, stop_event(current_step=150))
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(40, 2))
    logger = CSVLogger(str(tmp_path / "logs"), name="exp1")
    callback = diffmon.DiffmonEarlyStopping(run_dir, log_evaluations=True, verbose=False)
    trainer = pl.Trainer(max_steps=40, logger=logger, callbacks=[callback], accelerator="cpu",
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=1))
    assert callback.stopped and trainer.global_step == 6  # stopped after batch 5
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    ours = [(int(r["step"]), {k: float(v) for k, v in r.items() if k.startswith("diffmon/") and v})
            for r in rows if any(k.startswith("diffmon/") and v for k, v in r.items())]
    expected = [(s, metrics_of(record(s))) for s in (100, 200, 150)] + [(150, {"diffmon/early_stop": 1})]
    assert len(ours) == len(expected)
    for (step, got), (want_step, want) in zip(ours, expected):
        assert step == want_step and got == pytest.approx(want), (step, got)
    assert any(r.get("train_loss") for r in rows)  # the training's own metrics beside them
