"""diffmon's evaluations in Weights & Biases, offline (``WANDB_MODE=offline``), every run read back
from its ``.wandb`` transaction log by the SDK's own reader (``wandb leet inspect --json``, which
prints each record of the log as JSON): every metric at its custom step ``diffmon/step``, the
early stop's marker, summary and alert, nothing twice after a second poll or a new follower;
the training's own rows never dropped; accelerate's wandb tracker; the sidecar
``python -m diffmon.wandb`` (one pass, until the stop, a signal, a restart)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb", reason="wandb is not installed (python/requirements.txt)")

import diffmon  # noqa: E402
from diffmon.follow import metrics_of, stable_run_id  # noqa: E402
from journal_util import append, evaluation, record, resume, stop_event, write_stop  # noqa: E402

PYTHON_DIR = Path(__file__).resolve().parents[1]
EVENT_ID = "9f" * 32


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wb"), "WANDB_SILENT": "true",
           "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true",
           "WANDB_PROJECT": "diffmon-test"}
    (tmp_path / "wb").mkdir()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    yield dict(os.environ)
    wandb.teardown()  # the next test's settings (WANDB_DIR) are read afresh


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "runs" / "exp1"
    d.mkdir(parents=True)
    return d


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def inspect(path: Path) -> list[dict]:
    """The records of a run's transaction log, as the SDK's reader prints them."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, WANDB_MODE="offline"))
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def history(records: list[dict]) -> list[dict]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def points(records: list[dict]) -> list[tuple[int, dict]]:
    """(diffmon/step, the diffmon/ metrics) of each history row holding diffmon's metrics."""
    out = []
    for item in history(records):
        ours = {k: v for k, v in item.items() if k.startswith("diffmon/") and k != "diffmon/step"}
        if ours:
            out.append((item["diffmon/step"], ours))
    return out


def summary(records: list[dict]) -> dict:
    s = {}
    for r in records:
        if r["type"] == "summary":
            s.update(r["summary"].get("update", {}))
    return s


def alerts(records: list[dict]) -> list[dict]:
    return [r["alert"] for r in records if r["type"] == "alert"]


def assert_points(got: list, steps: list, marker_step: int = None) -> None:
    want = [(s, metrics_of(record(s))) for s in steps]
    if marker_step is not None:
        want.append((marker_step, {"diffmon/early_stop": 1}))
    assert len(got) == len(want), (got, want)
    for (step, ours), (want_step, expected) in zip(got, want):
        assert step == want_step and ours == pytest.approx(expected), (step, ours)


def assert_custom_step(records: list[dict]) -> None:
    metrics = [r["metric"] for r in records if r["type"] == "metric"]
    assert {"name": "diffmon/step", "options": {"defined": True}} in metrics, metrics
    assert any(m.get("glob_name") == "diffmon/*" and m.get("step_metric") == "diffmon/step"
               for m in metrics), metrics


def assert_early_stop_summary(s: dict) -> None:
    assert s["diffmon/early_stop"] == 1 and s["diffmon/early_stop_event"] == "early_stop"
    assert s["diffmon/early_stop_id"] == EVENT_ID and s["diffmon/early_stop_step"] == 150
    assert s["diffmon/best_step"] == 200 and s["diffmon/best_value"] == 0.78
    assert s["diffmon/best_checkpoint"] == "runs/exp1/ckpt_000200.pt"
    assert s["diffmon/best_checkpoint_kept"] == "runs/exp1/.diffmon/best/ckpt_000200.pt"
    assert s["diffmon/early_stop_trigger"] == "turn"
    assert s["diffmon/early_stop_summary"].startswith("diffmon early_stop on run exp1: best icr")


def a_history(run_dir: Path) -> None:
    """Three evaluations, a resume to step 100 and one of the new segment, at a lower step."""
    append(run_dir / ".diffmon", evaluation(100), evaluation(200), evaluation(300), resume(100),
           evaluation(150, path="/data/runs/exp1/ckpt_000150.pt"))


def test_a_run_of_the_training_gets_every_metric_at_its_custom_step(run_dir, wandb_env, tmp_path):
    a_history(run_dir)
    run = wandb.init(name="train", dir=str(tmp_path / "wb"))
    follower = diffmon.log_to(run, run_dir, wandb_rows="own")
    write_stop(run_dir, stop_event(current_step=150))
    assert follower.poll() == 1 and follower.poll() == 0
    # A restart of the follower in the same process logs nothing twice.
    assert diffmon.log_to(run, run_dir, wandb_rows="own").stop() == 0
    follower.stop()
    run.finish()
    (log,) = offline_runs(tmp_path / "wb")
    records = inspect(log)
    assert_custom_step(records)
    assert_points(points(records), [100, 200, 300, 150], marker_step=150)
    assert_early_stop_summary(summary(records))
    (alert,) = alerts(records)
    assert alert["level"] == "WARN" and alert["title"] == "diffmon: early stop on run exp1"
    assert "(kept as runs/exp1/.diffmon/best/ckpt_000200.pt)" in alert["text"]


def test_shared_rows_never_drop_the_trainings_own_steps(run_dir, wandb_env, tmp_path):
    """The training logs with step=global_step (as accelerate's tracker does); diffmon's points
    ride on its rows, one a row, so W&B's step never moves past the training's."""
    state = run_dir / ".diffmon"
    run = wandb.init(name="train", dir=str(tmp_path / "wb"))
    follower = diffmon.log_to(run, run_dir)  # rows="share", the default
    for step in range(30):
        if step == 3:
            append(state, evaluation(100), evaluation(200), evaluation(300))
        if step == 20:
            append(state, resume(100), evaluation(150, path="/x/150"))
            write_stop(run_dir, stop_event(current_step=150))
        run.log({"loss": 1.0 / (step + 1)}, step=step)
        follower.poll()
    diffmon.log_to(run, run_dir).poll()  # a second follower: nothing twice
    follower.stop()
    run.finish()
    records = inspect(offline_runs(tmp_path / "wb")[0])
    assert [item["_step"] for item in history(records) if "loss" in item] == list(range(30))
    assert_points(points(records), [100, 200, 300, 150], marker_step=150)
    assert len(alerts(records)) == 1 and summary(records)["diffmon/early_stop_id"] == EVENT_ID


def test_points_waiting_at_the_end_are_logged_by_stop(run_dir, wandb_env, tmp_path):
    a_history(run_dir)
    run = wandb.init(name="train", dir=str(tmp_path / "wb"))
    follower = diffmon.log_to(run, run_dir)  # shared rows: nothing the training logged yet
    run.log({"loss": 0.5}, step=7)
    follower.stop()  # what still waits gets rows of its own
    run.finish()
    records = inspect(offline_runs(tmp_path / "wb")[0])
    assert_points(points(records), [100, 200, 300, 150])
    assert [item["_step"] for item in history(records) if "loss" in item] == [7]


def test_a_resumed_run_skips_what_its_summary_says_was_logged(run_dir, wandb_env, tmp_path):
    """Online, W&B gives a resumed run its summary back (``run.resumed``); offline it cannot, so
    the summary an earlier start left is set here and the sink told the run was resumed."""
    from diffmon.follow import Follower, WandbSink

    a_history(run_dir)
    write_stop(run_dir, stop_event(current_step=150))
    run = wandb.init(name="train", dir=str(tmp_path / "wb"))
    run.summary["diffmon/evaluations_logged"] = 2
    run.summary["diffmon/events_logged"] = [f"early_stop:{EVENT_ID}"]
    Follower([WandbSink(run, resumed=True)], run_dir).stop()
    run.finish()
    records = inspect(offline_runs(tmp_path / "wb")[0])
    assert_points(points(records), [300, 150])
    assert alerts(records) == [] and summary(records)["diffmon/evaluations_logged"] == 4


def test_accelerates_wandb_tracker(run_dir, wandb_env, tmp_path):
    from accelerate import Accelerator

    state = run_dir / ".diffmon"
    accelerator = Accelerator(cpu=True, log_with="wandb")
    accelerator.init_trackers("diffmon-test", init_kwargs={"wandb": {"name": "accelerate", "dir": str(tmp_path / "wb")}})
    follower = diffmon.log_to(accelerator, run_dir)
    for step in range(12):
        if step == 2:
            a_history(run_dir)
        if step == 6:
            write_stop(run_dir, stop_event(current_step=150))
        accelerator.log({"loss": float(step)}, step=step)
        follower.poll()
    follower.stop()
    accelerator.end_training()
    records = inspect(offline_runs(tmp_path / "wb")[0])
    assert_custom_step(records)
    assert [item["_step"] for item in history(records) if "loss" in item] == list(range(12))
    assert_points(points(records), [100, 200, 300, 150], marker_step=150)
    assert_early_stop_summary(summary(records))
    assert len(alerts(records)) == 1
    assert state.is_dir() and sorted(p.name for p in state.iterdir()) == ["history.jsonl"]


# ---------------------------------------------------------------------------------------------
# python -m diffmon.wandb
# ---------------------------------------------------------------------------------------------

def sidecar(args: list, env: dict, **kw):
    env = dict(env, PYTHONPATH=str(PYTHON_DIR))
    return subprocess.Popen([sys.executable, "-m", "diffmon.wandb", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def finished(proc, timeout=120) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def run_record(records: list[dict]) -> dict:
    return next(r["run"] for r in records if r["type"] == "run")


def test_sidecar_once_and_a_restart(run_dir, wandb_env, tmp_path):
    a_history(run_dir)
    write_stop(run_dir, stop_event(current_step=150))
    out = finished(sidecar(["--run-dir", str(run_dir), "--once", "--project", "p1"], wandb_env))
    assert "5 points logged" in out, out
    (log,) = offline_runs(tmp_path / "wb")
    records = inspect(log)
    run = run_record(records)
    assert run["project"] == "p1" and run["run_group"] == "exp1" and run["job_type"] == "diffmon"
    assert run["display_name"] == "diffmon-exp1"
    # Offline, W&B cannot resume: each start is a run of its own, its id the stable one + time.
    assert run["run_id"].startswith(stable_run_id(run_dir / ".diffmon") + "-")
    assert_custom_step(records)
    assert_points(points(records), [100, 200, 300, 150], marker_step=150)
    s = summary(records)
    assert_early_stop_summary(s)
    assert s["diffmon/evaluations_logged"] == 4 and s["diffmon/events_logged"] == [f"early_stop:{EVENT_ID}"]
    assert len(alerts(records)) == 1
    assert records[-1]["type"] == "exit" and records[-1]["exit"].get("exit_code", 0) == 0
    # A restart: a second run with the whole history, once; the state folder untouched.
    append(run_dir / ".diffmon", evaluation(400))
    finished(sidecar(["--run-dir", str(run_dir / ".diffmon"), "--once", "--group", "g",
                      "--name", "again"], wandb_env))
    logs = offline_runs(tmp_path / "wb")
    assert len(logs) == 2
    (second,) = [p for p in logs if p != log]
    records = inspect(second)
    assert run_record(records)["run_group"] == "g" and run_record(records)["display_name"] == "again"
    assert_points(points(records), [100, 200, 300, 150, 400], marker_step=150)
    assert sorted(p.name for p in (run_dir / ".diffmon").iterdir()) == ["history.jsonl"]


def test_sidecar_follows_until_the_stop_file(run_dir, wandb_env, tmp_path):
    state = run_dir / ".diffmon"
    append(state, evaluation(100))
    proc = sidecar(["--run-dir", str(run_dir), "--poll-secs", "0.2"],
                   dict(wandb_env, WANDB_RUN_GROUP="sweep-7"))
    try:
        time.sleep(3)
        assert proc.poll() is None  # still following
        append(state, evaluation(200), resume(100))
        append(state, evaluation(150, path="/x/150"))
        write_stop(run_dir, stop_event(current_step=150))
        out = finished(proc, timeout=60)  # ends by itself once the stop file stands
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "the stop file" in out and "finishing" in out, out
    records = inspect(offline_runs(tmp_path / "wb")[0])
    assert run_record(records)["run_group"] == "sweep-7"
    assert_points(points(records), [100, 200, 150], marker_step=150)
    assert len(alerts(records)) == 1


def test_sidecar_follow_ends_at_sigterm(run_dir, wandb_env, tmp_path):
    state = run_dir / ".diffmon"
    append(state, evaluation(100))
    write_stop(run_dir, stop_event(current_step=100))
    # Its output in a file, read as it runs: each step waits for the poll that logged the last
    # one (W&B's start takes seconds on a loaded machine; fixed sleeps raced it).
    said = tmp_path / "sidecar.out"

    def polls() -> int:
        return said.read_text().count("points (") if said.exists() else 0

    def wait_polls(n: int):
        start = time.monotonic()
        while polls() < n:
            assert proc.poll() is None, said.read_text()
            assert time.monotonic() - start < 120, said.read_text()
            time.sleep(0.1)

    with open(said, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "diffmon.wandb", "--run-dir", str(run_dir), "--follow",
             "--poll-secs", "0.2"], env=dict(wandb_env, PYTHONPATH=str(PYTHON_DIR)),
            stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_polls(1)  # the evaluation and the stop
        time.sleep(1)
        assert proc.poll() is None  # --follow goes on past the stop
        append(state, evaluation(200))
        os.unlink(run_dir / "EARLY_STOP")  # the daemon resolved it
        wait_polls(2)  # the evaluation and the resolution
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, said.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    records = inspect(offline_runs(tmp_path / "wb")[0])
    got = points(records)
    assert [s for s, _ in got] == [100, 100, 200, 200]
    assert got[1][1] == {"diffmon/early_stop": 1} and got[3][1] == {"diffmon/early_stop": 0}
    s = summary(records)
    assert s["diffmon/early_stop"] == 0 and s["diffmon/early_stop_event"] == "resolved"
    assert [a["level"] for a in alerts(records)] == ["WARN", "INFO"]
    assert records[-1]["type"] == "exit"


def test_sidecar_usage_errors(run_dir, wandb_env):
    proc = sidecar(["--run-dir", str(run_dir), "--once", "--follow"], wandb_env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "not allowed with argument" in out
    proc = sidecar([], wandb_env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--run-dir" in out
