"""The README's "Your own run" steps, run exactly as the README writes them.

The fenced ``sh`` and ``python`` blocks of that section are taken from README.md and run in order
in a fresh folder holding a run of the toy trainer (the stand-in for a user's training job) with
only its checkpoints left, as a user's run folder has them. The environment is what the
README's Install block gives after ``make setup``: its ``. .venv/bin/activate`` line, run in the
checkout, puts ``diffmon`` (the release build, linked) and ``diffmon-export`` (the helpers,
installed) on PATH; no shim of the test's own.
The block that starts ``diffmon watch`` runs in the background; the blocks after it run while it
watches. The test checks what each step is for: the export writes the architecture, ``init``
writes a config that ``check-config`` accepts unchanged, ``eval`` prints the checkpoint's step and
ICR, and the watching daemon evaluates every checkpoint once and reports the last one on
``/v1/early-stop``.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BINARY = ROOT / "target" / "release" / "diffmon"
# Two checkpoints: enough for "every checkpoint once, in step order", at half the evaluations.
STEPS = [100, 200]


LATENT = "\n### A latent model: steps 1 to 3\n"


def own_run_blocks(latent: bool = False) -> list[tuple[str, str]]:
    """The blocks of "Your own run"'s seven steps, or (``latent``) of its latent variant."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Your own run\n")
    end = text.index("\n## ", start + 1)
    split = text.index(LATENT, start, end)
    start, end = (split, end) if latent else (start, split)
    return re.findall(r"```(sh|python)\n(.*?)```", text[start:end], re.S)


def activated_env() -> dict:
    """The environment after the Install block's activation line, run in the checkout."""
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Install\n")
    end = text.index("\n## ", start + 1)
    lines = [line.split("#")[0].strip() for block in re.findall(r"```sh\n(.*?)```", text[start:end], re.S)
             for line in block.splitlines()]
    activate = [line for line in lines if line.startswith(". .venv/bin/activate")]
    assert activate, "README's Install section has no `. .venv/bin/activate` line"
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "DIFFMON_LOG", "VIRTUAL_ENV")}
    # PATH as a login shell has it, without this test runner's venv.
    base["PATH"] = os.pathsep.join(p for p in base["PATH"].split(os.pathsep)
                                   if not p.startswith(str(ROOT)))
    out = subprocess.run(["bash", "-c", f"{activate[0]} && env -0"], cwd=ROOT, env=base,
                         capture_output=True, check=True)
    env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)
    for tool in ("diffmon", "diffmon-export"):
        found = subprocess.run(["bash", "-c", f"command -v {tool}"], env=env, capture_output=True,
                               text=True)
        if found.returncode != 0:
            pytest.fail(f"`{tool}` is not on PATH after `{activate[0]}`: run `make setup` first")
    return env


def evaluations(journal: Path) -> list[dict]:
    if not journal.exists():
        return []
    text = journal.read_text()
    lines = text[: text.rfind("\n") + 1].splitlines()
    return [e["record"] for e in map(json.loads, lines) if e.get("kind") == "evaluation"]


def test_the_steps_reach_a_watched_evaluated_checkpoint(tmp_path):
    if not BINARY.is_file():
        pytest.fail(f"{BINARY} is missing: run `make setup` (or `cargo build --release`) first")
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 9464)) == 0:
            pytest.fail("127.0.0.1:9464 is in use; the README's watch step serves there")
    blocks = own_run_blocks()
    assert [lang for lang, _ in blocks] == ["sh", "python", "sh", "sh", "sh", "sh", "sh", "python"], blocks

    # The user's side: the toy trainer's run, with only its checkpoints left.
    (tmp_path / "python").symlink_to(ROOT / "python")
    run = tmp_path / "runs" / "exp1"
    subprocess.run([sys.executable, "python/train_toy.py", "--run-dir", str(run), "--steps", "200",
                    "--ckpt-every", "100"], check=True, cwd=tmp_path, capture_output=True)
    for f in ("model.ts", "train.h5", "heldout.h5"):
        (run / f).unlink()
    assert sorted(p.name for p in run.iterdir()) == [f"ckpt_{s:06d}.pt" for s in STEPS]

    env = activated_env()
    py_env = dict(env, PYTHONPATH="python")  # the toy's modules and the helpers, as for the user

    outputs = []
    watch = None
    watch_log = open(tmp_path / "watch.log", "w")
    try:
        for lang, code in blocks:
            if lang == "sh" and "diffmon watch" in code:
                watch = subprocess.Popen(["bash", "-c", code], cwd=tmp_path, env=env,
                                         stdout=watch_log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
                journal = run / ".diffmon" / "history.jsonl"
                deadline = time.monotonic() + 180
                while len(evaluations(journal)) < len(STEPS):
                    assert watch.poll() is None, (tmp_path / "watch.log").read_text()
                    assert time.monotonic() < deadline, (tmp_path / "watch.log").read_text()
                    time.sleep(0.5)
                outputs.append("")
                continue
            argv = ["bash", "-euo", "pipefail", "-c", code] if lang == "sh" else ["python", "-c", code]
            out = subprocess.run(argv, cwd=tmp_path, env=py_env if lang == "python" else env,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, f"{code}\nexit {out.returncode}\n{out.stdout}\n{out.stderr}"
            outputs.append(out.stdout)
    finally:
        if watch is not None and watch.poll() is None:
            os.killpg(watch.pid, signal.SIGTERM)
            watch.wait(timeout=150)
        watch_log.close()

    export_out, h5_out, init_out, check_out, eval_out, _, status_out, loop_out = outputs
    assert (run / "model.ts").is_file() and (run / "train.h5").is_file()
    config = (tmp_path / "diffmon.yaml").read_text()
    assert "runs/exp1" in config and "name: exp1" in config, config
    assert ": ok" in check_out, check_out
    # `eval` names the step and gives an ICR in (0, 1].
    m = re.search(r"step\s+200\s+icr (\d\.\d+)", eval_out)
    assert m and 0 < float(m.group(1)) <= 1, eval_out
    # The daemon evaluated every checkpoint exactly once, in step order.
    records = evaluations(run / ".diffmon" / "history.jsonl")
    assert [r["step"] for r in records] == STEPS, records
    # Evaluations are deterministic: the watched ICR of step 200 is what `eval` printed.
    assert f"{records[-1]['icr']:.5f}" == m.group(1), (records[-1], eval_out)
    status = json.loads(status_out)
    assert status["last_step"] == 200 and status["fired"] is False, status
    assert loop_out == ""
