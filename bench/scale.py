"""The `scale` workload of `make bench` (BENCHMARKS.md, "Scale"): how diffmon's own cost grows
with the work, the network kept trivially small (the toy model, ICR on 16 view pairs) so that
what is measured is the daemon around it.

Histories are written as the daemon writes them: one journal line per evaluation in the run's
state folder (`<run>/.diffmon/history.jsonl`), each a copy of a real record that `diffmon eval`
made of the toy checkpoint, its step, checkpoint name and key renumbered; those checkpoints are
no longer on disk (rotated away, as in a long run). The daemon then replays them at its start as
it would after a restart, and evaluates real checkpoints on top.

  sweep      one daemon, 64 runs (`runs_glob`), with 0 and then 500 recorded evaluations each
             (32 000 in all): start-up (to /healthz) and replay (every run's last step on
             /v1/early-stop) time, resident memory, the answer time of /, /runs/<run>, /metrics
             and /v1/*, and the bookkeeping per checkpoint while 4 new checkpoints a run (256)
             are evaluated.
  one run    0 and 10 000 recorded evaluations: the bookkeeping per checkpoint over 40 new ones,
             resident memory, and `diffmon report` (HTML) on 500 and 10 000 points.

Bookkeeping per checkpoint is the daemon's CPU seconds per evaluated checkpoint less the
evaluation's own seconds (`diffmon_evaluation_duration_seconds`, stage total), the network
running on one thread (`cpu_threads: 1`): everything the daemon does for a checkpoint besides
reading and evaluating it (finding and pinning it, the journal and `history.h5`, the detector,
the metrics, the page's state). Its target is under 5 ms and flat in the history's length.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

RUNS, HISTORY, NEW_PER_RUN = 64, 500, 4
LONG_HISTORY, NEW_ONE_RUN = 10_000, 40
CKPT = "ckpt_{:06d}.pt"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(path: Path, toy: Path, port: int, run: str) -> Path:
    path.write_text(
        f"{run}\nmodel: {{architecture: {toy / 'model.ts'}}}\ndevice: cpu\ncpu_threads: 1\n"
        f"data: {{path: {toy / 'train.h5'}}}\nhttp: {{listen: '127.0.0.1:{port}'}}\n"
        "checkpoints: {pattern: 'ckpt_*.pt', settle_secs: 0.1, poll_secs: 0.2}\n"
        "icr: {samples: 16, batch_size: 16}\npfd: {enabled: false}\nearly_stop: {confirm: none}\n"
    )
    return path


def _template(bin_: Path, work: Path, toy: Path) -> dict:
    """A real evaluation record of the toy checkpoint (`diffmon eval --json`)."""
    run = work / "template-run"
    run.mkdir(exist_ok=True)
    cfg = _config(work / "template.yaml", toy, _free_port(),
                  f"run: {{dir: {run}}}\nstate_dir: {work / 'template.state'}")
    out = subprocess.run([str(bin_), "eval", "--config", str(cfg), str(toy / "ckpt_000200.pt"), "--json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _write_history(run_dir: Path, template: dict, n: int) -> None:
    state = run_dir / ".diffmon"
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    lines = []
    for step in range(1, n + 1):
        path = str(run_dir / CKPT.format(step))
        record = {**template, "step": step, "checkpoint": path}
        lines.append(json.dumps({
            "kind": "evaluation",
            "key": {"path": path, "size": 1000, "mtime_ns": 1_700_000_000_000_000_000 + step},
            "at": "2026-12-01T00:00:00.000Z", "record": record}))
    (state / "history.jsonl").write_text("".join(line + "\n" for line in lines))


class _Watch:
    def __init__(self, bin_: Path, cfg: Path, port: int, log: Path):
        self.port = port
        self.log = open(log, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen([str(bin_), "watch", "--config", str(cfg)], stdout=self.log,
                                     stderr=subprocess.STDOUT,
                                     env={**os.environ, "DIFFMON_LOG": "info"})
        self.up_s = self._until(lambda: self.get("/healthz") is not None, "/healthz")

    def _until(self, ok, what: str, limit: float = 600) -> float:
        while not ok():
            if self.proc.poll() is not None or time.perf_counter() > self.t0 + limit:
                raise SystemExit(f"diffmon watch: no {what}; see {self.log.name}")
            time.sleep(0.05)
        return time.perf_counter() - self.t0

    def get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.read().decode()
        except OSError:
            return None

    def total(self, name: str, labels: str = "") -> float:
        text = self.get("/metrics") or ""
        return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M))

    def evaluated(self) -> float:
        return self.total("diffmon_checkpoints_evaluated_total")

    def last_steps(self) -> list[int]:
        """Each run's last evaluated step (`/v1/early-stop`: one status, or one per run)."""
        status = json.loads(self.get("/v1/early-stop") or "{}")
        runs = [status] if "last_step" in status else list(status.values())
        return [s.get("last_step") or 0 for s in runs] or [0]

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) / 1024

    def answer_ms(self, path: str, times: int = 20) -> tuple[float, float]:
        """Median and slowest answer of `path`, in ms."""
        took = []
        for _ in range(times):
            t = time.perf_counter()
            if self.get(path) is None:
                raise SystemExit(f"diffmon watch: {path} did not answer; see {self.log.name}")
            took.append((time.perf_counter() - t) * 1000)
        return statistics.median(took), max(took)

    def bookkeeping(self, src: Path, runs: list[Path], first: int, rounds: int) -> dict:
        """Places `rounds` new checkpoints in each run (a round at a time, the next as soon as
        the one before is being evaluated) and measures per checkpoint: the daemon's CPU less
        the evaluation's own seconds, and the wall time."""
        stage = lambda: self.total("diffmon_evaluation_duration_seconds_sum", 'stage="total"')
        n0, s0, c0, t0 = self.evaluated(), stage(), self.cpu_s(), time.perf_counter()
        for r in range(rounds):
            for run in runs:
                tmp = run / f".{CKPT.format(first + r)}.tmp"
                shutil.copy(src, tmp)
                os.replace(tmp, run / CKPT.format(first + r))
            # The round before is done (one round kept waiting). Asked of /v1/early-stop, which
            # costs the daemon well under a millisecond; /metrics would cost it 12 ms a poll in
            # a sweep, counted here as bookkeeping.
            self._until(lambda: min(self.last_steps()) >= first + r - 1, f"step {first + r - 1}")
        self._until(lambda: min(self.last_steps()) >= first + rounds - 1, f"step {first + rounds - 1}")
        n = self.evaluated() - n0
        cpu, own, wall = self.cpu_s() - c0, stage() - s0, time.perf_counter() - t0
        return {"checkpoints": int(n), "bookkeeping_ms": (cpu - own) / n * 1000,
                "evaluation_ms": own / n * 1000, "wall_ms": wall / n * 1000}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _sweep(bin_: Path, work: Path, toy: Path, template: dict, history: int, quick: bool) -> dict:
    runs_n, new = (8, 2) if quick else (RUNS, NEW_PER_RUN)
    at = work / f"scale-sweep-{history}"
    shutil.rmtree(at, ignore_errors=True)
    runs = [at / "sweep" / f"lr-{i:02d}" for i in range(runs_n)]
    for run in runs:
        run.mkdir(parents=True)
        _write_history(run, template, history)
    port = _free_port()
    cfg = _config(at / "diffmon.yaml", toy, port, f"runs_glob: {at / 'sweep' / 'lr-*'}\nmax_runs: {runs_n}")
    d = _Watch(bin_, cfg, port, at / "watch.log")
    try:
        def replayed() -> bool:
            status = json.loads(d.get("/v1/early-stop") or "{}")
            return len(status) == runs_n and all(s.get("last_step") == (history or None)
                                                 for s in status.values())
        replay_s = d._until(replayed, "replayed histories")
        rss_start = d.rss_mib()
        pages = {p: d.answer_ms(p) for p in ("/", "/runs/lr-00", "/metrics", "/v1/early-stop",
                                               "/v1/runs/lr-00/early-stop")}
        cost = d.bookkeeping(toy / "ckpt_000200.pt", runs, history + 1, new)
        return {"runs": runs_n, "history": history, "recorded": runs_n * history,
                "startup_s": d.up_s, "replay_s": replay_s, "rss_start_mib": rss_start,
                "rss_end_mib": d.rss_mib(), "pages_ms": pages, **cost}
    finally:
        d.stop()


def _one_run(bin_: Path, work: Path, toy: Path, template: dict, history: int, quick: bool) -> dict:
    new = 10 if quick else NEW_ONE_RUN
    at = work / f"scale-one-{history}"
    shutil.rmtree(at, ignore_errors=True)
    run = at / "run"
    run.mkdir(parents=True)
    _write_history(run, template, history)
    port = _free_port()
    cfg = _config(at / "diffmon.yaml", toy, port, f"run: {{dir: {run}}}")
    d = _Watch(bin_, cfg, port, at / "watch.log")
    try:
        replay_s = d._until(lambda: json.loads(d.get("/v1/early-stop") or "{}").get("last_step")
                            == (history or None), "a replayed history")
        cost = d.bookkeeping(toy / "ckpt_000200.pt", [run], history + 1, new)
        result = {"runs": 1, "history": history, "startup_s": d.up_s, "replay_s": replay_s,
                  "rss_end_mib": d.rss_mib(), "page_ms": d.answer_ms("/"), **cost}
    finally:
        d.stop()
    t = time.perf_counter()
    subprocess.run([str(bin_), "report", "--config", str(cfg), "--out", str(at / "report.html")],
                   check=True, capture_output=True)
    result["report_s"] = time.perf_counter() - t
    return result


def bench_scale(bin_: Path, work: Path, toy: Path, quick: bool) -> list[dict]:
    template = _template(bin_, work, toy)
    sweep_history = 50 if quick else HISTORY
    one_history = 1000 if quick else LONG_HISTORY
    rows = []
    for name, fn, sizes in (("sweep", _sweep, (0, sweep_history)),
                            ("one run", _one_run, (0, 500, one_history))):
        points = [fn(bin_, work, toy, template, h, quick) for h in sizes]
        base = points[0]
        for p in points:
            rows.append({"workload": f"scale, {name}, {p['runs']} × {p['history']} recorded",
                         "unit": "ms", "diffmon": p["bookkeeping_ms"],
                         "reference": base["bookkeeping_ms"],
                         "ratio": p["bookkeeping_ms"] / base["bookkeeping_ms"],
                         "diffmon_rss_mib": p["rss_end_mib"],
                         "target": "bookkeeping < 5 ms a checkpoint, flat in the history", **p})
    return rows
