"""``diffmon watch`` on the GPU end to end: the daemon starts on the device, finds a checkpoint
dropped into the run folder, evaluates it, serves it on /metrics, and exits 0 on SIGTERM."""

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def _metric(text: str, series: str) -> float | None:
    m = re.search(rf"^{re.escape(series)} (\S+)$", text or "", re.M)
    return float(m.group(1)) if m else None


def test_watch_on_cuda_serves_metrics_and_stops_cleanly(dm, tier, tmp_path, measure):
    device = tier.dev("cuda")
    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    cfg = dm.config(tmp_path / "diffmon.yaml", device,
                    f"http: {{listen: '127.0.0.1:{port}'}}\n"
                    "checkpoints: {pattern: 'ckpt_*.pt', step_regex: 'ckpt_(\\d+)', "
                    "settle_secs: 0.5, poll_secs: 0.5}\n"
                    f"icr: {{samples: {tier.n(512)}, batch_size: 256, seed: 3}}\n"
                    "early_stop: {confirm: none}\n", run_dir=run)
    log = tmp_path / "daemon.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([tier.binary, "watch", "--config", str(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "DIFFMON_LOG": "info"})
    try:
        def wait(what, cond, seconds):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                value = cond()
                if value:
                    return value
                assert proc.poll() is None, f"watch exited {proc.returncode} while waiting for " \
                    f"{what}; log:\n{log.read_text()[-4000:]}"
                time.sleep(0.2)
            raise AssertionError(f"timed out after {seconds} s waiting for {what}; log:\n"
                                 f"{log.read_text()[-4000:]}")

        # Model load, device start-up and the HTTP endpoint.
        wait("/healthz", lambda: (_get(port, "/healthz") or "").strip() == "ok", 180)
        up = time.monotonic() - started
        # The checkpoint arrives as a trainer writes it: under another name, then renamed.
        shutil.copy(dm.assets.checkpoint, run / "partial.tmp")
        os.rename(run / "partial.tmp", run / "ckpt_000100.pt")
        dropped = time.monotonic()
        text = wait("diffmon_checkpoints_evaluated_total 1 and diffmon_icr on /metrics",
                    lambda: (lambda t: t if _metric(t, 'diffmon_checkpoints_evaluated_total{run="gpu"}') == 1
                             and _metric(t, 'diffmon_icr{run="gpu"}') is not None else None)(
                                 _get(port, "/metrics")), 300)
        seen = time.monotonic() - dropped
        icr = _metric(text, 'diffmon_icr{run="gpu"}')
        assert 0 < icr <= 1, icr
        assert _metric(text, 'diffmon_last_evaluated_step{run="gpu"}') == 100
        failures = re.findall(r'^diffmon_checkpoint_failures_total\{[^}]*\} (\S+)$', text, re.M)
        assert all(float(v) == 0 for v in failures), failures

        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0, f"watch exited {rc} on SIGTERM; log:\n{log.read_text()[-4000:]}"
    journal = (tmp_path / "diffmon.state" / "history.jsonl").read_text()
    assert '"kind":"evaluation"' in journal.replace(" ", ""), journal
    measure(f"device {device}: up in {up:.1f} s, checkpoint on /metrics {seen:.1f} s after the "
            f"drop, diffmon_icr {icr:.6f}, SIGTERM exit {rc}")
