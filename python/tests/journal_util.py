"""Journals and stop files written by hand in the daemon's documented format (docs/design.md §13
and §17), as serde_json writes them: one compact JSON object per line."""

import json
import os
from pathlib import Path

AT = "2026-01-01T00:00:00Z"


def record(step: int, **fields) -> dict:
    """A record as the daemon journals it for the toy's run: ICR with its traces, spectrum and
    standard error, E_mem, the memorization ratio, the losses and the gap, the seconds."""
    r = {
        "step": step, "checkpoint": f"runs/exp1/ckpt_{step:06d}.pt",
        "icr": 0.8 - step / 10000, "icr_invariant_trace": 1.5 + step / 1000,
        "icr_residual_trace": 0.25, "icr_eigenvalues": [0.1, 0.2, 0.3],
        "icr_invariant_trace_normalized": 0.5, "icr_residual_trace_normalized": 0.125,
        "icr_stderr": 0.004, "icr_samples": 2048,
        "icr_sweep": [{"sigma": 0.29, "icr": 0.8, "stderr": 0.004}],
        "pfd_memorization": 0.0625 + step / 100000, "memorization_ratio": step / 10000,
        "loss_train": 0.25, "loss_heldout": 0.26 + step / 100000,
        "generalization_gap": 0.01 + step / 100000, "generalization_gap_stderr": 0.002,
        "seconds": 1.5,
    }
    r.update(fields)
    return {k: v for k, v in r.items() if v is not None}


def evaluation(step: int, path: str = "", **fields) -> dict:
    path = path or f"/data/runs/exp1/ckpt_{step:06d}.pt"
    return {"kind": "evaluation",
            "key": {"path": path, "size": 1000 + step, "mtime_ns": 1767225600000000000 + step},
            "at": AT, "record": record(step, **fields)}


def failure(step: int) -> dict:
    return {"kind": "failure",
            "key": {"path": f"/data/runs/exp1/ckpt_{step:06d}.pt", "size": 7, "mtime_ns": 1},
            "at": AT, "step": step, "reason": "unreadable", "message": "truncated zip"}


def resume(step: int) -> dict:
    return {"kind": "resume", "at": AT, "step": step,
            "checkpoint": f"runs/exp1/ckpt_{step:06d}.pt",
            "set_aside": [f"runs/exp1/.diffmon/set-aside/ckpt_{step + 100:06d}.pt"]}


def line(entry: dict) -> bytes:
    return (json.dumps(entry, separators=(",", ":")) + "\n").encode()


def append(state_dir: Path, *entries, raw: bytes = b"") -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "history.jsonl"
    with open(path, "ab") as f:
        for e in entries:
            f.write(line(e))
        f.write(raw)
    return path


def rewrite(state_dir: Path, *entries) -> None:
    """As the daemon rewrites its journal at start: a new file renamed into place."""
    tmp = state_dir / ".history.jsonl.tmp"
    tmp.write_bytes(b"".join(line(e) for e in entries))
    os.replace(tmp, state_dir / "history.jsonl")


def stop_event(kind: str = "early_stop", current_step: int = 300, **fields) -> dict:
    e = {"id": "9f" * 32, "event": kind, "run": "exp1", "metric": "icr", "trigger": "turn",
         "best_step": 200, "best_checkpoint": "runs/exp1/ckpt_000200.pt",
         "best_checkpoint_kept": "runs/exp1/.diffmon/best/ckpt_000200.pt", "best_value": 0.78,
         "current_step": current_step, "current_value": 0.79, "fired_at": AT}
    e.update(fields)
    return e


def write_stop(run_dir: Path, event: dict) -> None:
    tmp = run_dir / ".EARLY_STOP.tmp"
    tmp.write_text(json.dumps(event))
    os.replace(tmp, run_dir / "EARLY_STOP")
