"""The W&B path over a real daemon's journal and stop file: the toy trainer's checkpoints, evaluated
by ``diffmon watch`` (the release build) until its early stop fires, then ``diffmon resume`` and a
second segment at lower steps. A follower in this process (an offline W&B run) and the sidecar
``python -m diffmon.wandb --follow`` beside it log every evaluation the daemon journaled, with the
record's own values at its step, the early stop (its real event id) and its withdrawal by the
resume, each once; both runs are read back with ``wandb leet inspect --json``.

The curve is made to turn: after the trainer's four checkpoints, two copies of the one with the
highest ICR come at later steps, and the detector (window 1, patience 2, no noise rule, no
confirmation) fires on the second."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb", reason="wandb is not installed (python/requirements.txt)")

import diffmon  # noqa: E402
from diffmon.follow import metrics_of  # noqa: E402
from test_wandb import alerts, inspect, offline_runs, points, summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / "target" / "release" / "diffmon"
pytestmark = pytest.mark.skipif(not BINARY.is_file(),
                                reason=f"{BINARY} is missing: run `make setup` (or `cargo build "
                                       "--release`) to test against the real daemon")

CONFIG = """\
run: {dir: exp1, name: exp1}
checkpoints: {pattern: "ckpt_*.pt", settle_secs: 0.2, poll_secs: 0.5}
model: {architecture: exp1/model.ts}
device: cpu
cpu_threads: 1
data: {path: exp1/train.h5, heldout_path: exp1/heldout.h5}
icr: {samples: 256, batch_size: 128}
pfd: {enabled: true, samples: 32, steps: 4, batch_size: 32}
memorization: {enabled: true}
early_stop: {window: 1, warmup: 0, patience: 2, min_rise: 0.001, noise_multiple: 0,
             confirm: none, memorization_level: 0}
http: {listen: "127.0.0.1:0"}
"""


def journal(run_dir: Path) -> list[dict]:
    path = run_dir / ".diffmon" / "history.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def evaluations(run_dir: Path) -> list[dict]:
    return [e["record"] for e in journal(run_dir) if e["kind"] == "evaluation"]


def copy_in(run_dir: Path, source: str, step: int) -> None:
    tmp = run_dir / ".copy.tmp"
    shutil.copyfile(run_dir / source, tmp)
    os.replace(tmp, run_dir / f"ckpt_{step:06d}.pt")


def test_a_real_daemons_evaluations_and_early_stop_in_wandb(tmp_path, monkeypatch):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true",
           "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true",
           "WANDB_PROJECT": "diffmon-test"}
    (tmp_path / "wb").mkdir()
    (tmp_path / "sidecar").mkdir()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    run_dir = tmp_path / "exp1"
    subprocess.run([sys.executable, str(ROOT / "python" / "train_toy.py"), "--run-dir", str(run_dir),
                    "--steps", "200", "--ckpt-every", "50", "--width", "8", "--heldout-size", "64"],
                   check=True, capture_output=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
    (tmp_path / "diffmon.yaml").write_text(CONFIG)
    daemon_env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", DIFFMON_LOG="warn")
    log = open(tmp_path / "watch.log", "w")

    def watch():
        return subprocess.Popen([str(BINARY), "watch", "--config", "diffmon.yaml"], cwd=tmp_path,
                                env=daemon_env, stdout=log, stderr=subprocess.STDOUT)

    def until(done, what, follower, timeout=90):
        deadline = time.monotonic() + timeout
        while not done():
            assert daemon.poll() is None, (tmp_path / "watch.log").read_text()
            assert time.monotonic() < deadline, f"{what}: {(tmp_path / 'watch.log').read_text()}"
            follower.poll()
            time.sleep(0.2)

    def stop_daemon():
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=120) == 0, (tmp_path / "watch.log").read_text()

    sidecar = subprocess.Popen([sys.executable, "-m", "diffmon.wandb", "--run-dir", str(run_dir),
                                "--follow", "--poll-secs", "0.3"],
                               env=dict(os.environ, PYTHONPATH=str(ROOT / "python"),
                                        WANDB_DIR=str(tmp_path / "sidecar")),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = wandb.init(name="train", dir=str(tmp_path / "wb"))
    daemon = watch()
    try:
        follower = diffmon.log_to(run, run_dir, wandb_rows="own")
        until(lambda: len(evaluations(run_dir)) == 4, "the trainer's four checkpoints", follower)
        highest = max(evaluations(run_dir), key=lambda r: r["icr"])["step"]
        copy_in(run_dir, f"ckpt_{highest:06d}.pt", 250)
        until(lambda: len(evaluations(run_dir)) == 5, "the first copy", follower)
        copy_in(run_dir, f"ckpt_{highest:06d}.pt", 300)
        until(lambda: len(evaluations(run_dir)) == 6 and (run_dir / "EARLY_STOP").exists(),
              "the early stop", follower)
        event = json.loads((run_dir / "EARLY_STOP").read_text())
        time.sleep(1.0)  # the sidecar (0.3 s) sees the stop file too
        follower.poll()
        stop_daemon()
        # Resume from the best: a new segment; the stop file goes, the later checkpoints aside.
        subprocess.run([str(BINARY), "resume", "--config", "diffmon.yaml"], cwd=tmp_path,
                       check=True, capture_output=True, env=daemon_env)
        assert not (run_dir / "EARLY_STOP").exists()
        follower.poll()  # the stop withdrawn, at the last step evaluated (300)
        time.sleep(1.0)  # and by the sidecar, before the new segment's first evaluation
        copy_in(run_dir, "ckpt_000050.pt", 250)  # the new branch's step 250: lower than 300
        daemon = watch()
        until(lambda: len(evaluations(run_dir)) == 7, "the new segment's checkpoint", follower)
        stop_daemon()
        follower.stop()
        run.finish()
        time.sleep(1.0)
        sidecar.send_signal(signal.SIGTERM)
        out, _ = sidecar.communicate(timeout=120)
        assert sidecar.returncode == 0, out
    finally:
        wandb.teardown()
        for proc in (daemon, sidecar):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()

    records = evaluations(run_dir)
    assert [r["step"] for r in records] == [50, 100, 150, 200, 250, 300, 250]
    assert [e["kind"] for e in journal(run_dir)].count("resume") == 1
    assert event["event"] == "early_stop" and event["current_step"] in (150, 200, 250, 300)
    # What the follower should have logged: each record's metrics at its step, the marker at the
    # event's step after the evaluation that fired it, 0 at the resume (at the last step then).
    fired = [r["step"] for r in records].index(event["current_step"])
    expected = [(r["step"], metrics_of(r)) for r in records]
    expected.insert(6, (300, {"diffmon/early_stop": 0}))
    expected.insert(fired + 1, (event["current_step"], {"diffmon/early_stop": 1}))
    for name, folder in (("in-process", tmp_path / "wb"), ("sidecar", tmp_path / "sidecar")):
        (path,) = offline_runs(folder)
        got = inspect(path)
        ours = points(got)
        assert [s for s, _ in ours] == [s for s, _ in expected], (name, ours)
        for (step, values), (_, want) in zip(ours, expected):
            assert values == pytest.approx(want), (name, step, values, want)
        # The real records have these, so every tag of the issue but the teacher's and the
        # tails' is there (E_gen needs pfd.teacher, the tails tail.enabled).
        for tag in ("diffmon/icr", "diffmon/icr_stderr", "diffmon/pfd_memorization",
                    "diffmon/memorization_ratio", "diffmon/generalization_gap",
                    "diffmon/loss_train", "diffmon/loss_heldout", "diffmon/evaluation_seconds"):
            assert tag in ours[0][1], (name, tag, ours[0][1])
        s = summary(got)
        assert s["diffmon/early_stop_id"] == event["id"] and s["diffmon/early_stop"] == 0
        assert s["diffmon/best_step"] == event["best_step"]
        assert s["diffmon/best_checkpoint_kept"] == event["best_checkpoint_kept"]
        assert [a["level"] for a in alerts(got)] == ["WARN", "INFO"], name
