"""``python -m diffmon.wandb``: diffmon's evaluations in a W&B run of their own, beside the job.

No change to the training code: the command creates a W&B run (job type ``diffmon``, in the
training run's group), follows the daemon's journal and stop file (diffmon.follow) and logs
every evaluation at its checkpoint's step (the custom step ``diffmon/step``), the early stop as
the marker ``diffmon/early_stop``, the run's summary and an alert::

    python -m diffmon.wandb --run-dir runs/exp1 --project my-project --group exp1
    python -m diffmon.wandb --run-dir runs/exp1 --once     # what is there now, then finish

It ends when told: ``--once`` after one pass over what is there; by default (``--until-stop``)
once the stop file stands (after logging the early stop); ``--follow`` only at SIGINT or SIGTERM.
Each of them finishes the W&B run properly.

A restart resumes the same W&B run: its id is derived from the state folder's absolute path
(``--id`` sets another) and the run is opened with ``resume="allow"``; the summary's
``diffmon/evaluations_logged`` and ``diffmon/events_logged`` say what the earlier start logged,
so nothing is logged twice. W&B cannot resume a run offline (``WANDB_MODE=offline``): there
each start is a run of its own (the id gets the start time), holding the whole history.
See docs/guide/trackers.md, "Weights & Biases".
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .follow import Follower, WandbSink, resolve_dirs, stable_run_id

log = logging.getLogger("diffmon.wandb")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m diffmon.wandb",
        description="Log the evaluations and the early stop of the diffmon daemon watching a run "
                    "into a W&B run of their own (docs/guide/trackers.md).")
    ap.add_argument("--run-dir", required=True,
                    help="the training run's folder (the daemon's run.dir), or its state folder")
    ap.add_argument("--state-dir", default=None,
                    help="the daemon's state folder (default: <run-dir>/.diffmon)")
    ap.add_argument("--stop-file", default="EARLY_STOP",
                    help="the stop file's name in the run folder (alerts.stop_file)")
    ap.add_argument("--project", default=None, help="W&B project (default: WANDB_PROJECT)")
    ap.add_argument("--entity", default=None, help="W&B entity (default: WANDB_ENTITY)")
    ap.add_argument("--group", default=None,
                    help="W&B group: the training run's (default: WANDB_RUN_GROUP, else the run "
                         "folder's name)")
    ap.add_argument("--name", default=None,
                    help="the W&B run's name (default: diffmon-<run folder name>)")
    ap.add_argument("--id", default=None,
                    help="the W&B run id (default: derived from the state folder, so that a "
                         "restart resumes the run)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true",
                      help="log what the journal holds now, then finish")
    mode.add_argument("--until-stop", action="store_true",
                      help="follow until the stop file stands (the default)")
    mode.add_argument("--follow", action="store_true",
                      help="follow until SIGINT or SIGTERM, logging resolutions too")
    ap.add_argument("--poll-secs", type=float, default=5.0,
                    help="seconds between reads of the journal (default 5)")
    return ap


def _group(args: argparse.Namespace, run_dir: Optional[Path], state_dir: Path) -> str:
    if args.group:
        return args.group
    if os.environ.get("WANDB_RUN_GROUP"):
        return os.environ["WANDB_RUN_GROUP"]
    return (run_dir or state_dir).resolve().name


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.poll_secs <= 0:
        parser().error("--poll-secs must be positive")
    logging.basicConfig(level=logging.INFO, format="diffmon.wandb: %(levelname)s %(message)s")
    try:
        import wandb
    except ImportError as e:
        print(f"diffmon.wandb: needs the wandb package (`pip install wandb`): {e}",
              file=sys.stderr)
        return 1
    run_dir, state_dir = resolve_dirs(args.run_dir, args.state_dir)
    folder = (run_dir or state_dir).resolve().name
    offline = os.environ.get("WANDB_MODE", "").lower() in ("offline", "dryrun")
    run_id = args.id or stable_run_id(state_dir)
    if offline:
        run_id = f"{run_id}-{time.strftime('%Y%m%d%H%M%S', time.gmtime())}"
    run = wandb.init(project=args.project, entity=args.entity, group=_group(args, run_dir, state_dir),
                     name=args.name or f"diffmon-{folder}", job_type="diffmon", id=run_id,
                     resume=None if offline else "allow",
                     config={"diffmon_run_dir": str(run_dir) if run_dir else None,
                             "diffmon_state_dir": str(state_dir)})
    follower = Follower([WandbSink(run, rows="own")], run_dir, state_dir, args.stop_file)
    halt = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        halt.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    logged = 0
    try:
        while True:
            new = follower.poll()
            if new:
                log.info("logged %d points (%d in all)", new, logged + new)
            logged += new
            if not follower.caught_up:
                continue  # more than one read's worth waits: read on at once
            if args.once or halt.is_set():
                break
            if not args.follow and follower.stopped:
                log.info("the stop file %s stands: finishing", follower.run_dir / args.stop_file)
                break
            halt.wait(args.poll_secs)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        logged += follower.stop()
        log.info("%d points logged into W&B run %s", logged, run.id)
        run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
