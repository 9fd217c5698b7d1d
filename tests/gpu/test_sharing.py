"""Sharing the GPU with a training job
(docs/guide/cost-and-gpu.md, "Sharing the GPU with the training job"): the memory PyTorch's
allocator cached is given back after each evaluation (another process sees it free),
``evaluation.gpu_memory_mib`` caps what an evaluation reserves (batches sized to it, the same
numbers), and ``evaluation.gpu_share`` keeps the forward passes to their share of the time."""

import os
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from test_watch import free_port

GIB = 1 << 30


def _icr_body(tier, samples: int, batch: int, extra: str = "") -> str:
    return (f"icr: {{samples: {tier.n(samples)}, batch_size: {batch}, seed: 3}}\n"
            "pfd: {enabled: false}\nearly_stop: {confirm: none}\n"
            f"evaluation: {{gpu_share: 1{extra}}}\n")


def _metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_memory_is_given_back_after_each_evaluation(dm, tier, tmp_path, measure):
    """A second process (this one) sees the GPU memory of an evaluation free again once it is
    done, while the daemon still runs: only the CUDA context, the weights and the fixed inputs
    stay. Without the release, the allocator would keep the evaluation's whole peak cached."""
    if tier.dry_run:
        pytest.skip("GPU memory only exists on a GPU")
    import torch

    torch.cuda.init()
    free_before = torch.cuda.mem_get_info()[0]
    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    # One forward of 4096 images: gigabytes of activations for the tier's UNet.
    cfg = dm.config(tmp_path / "c.yaml", "cuda",
                    f"http: {{listen: '127.0.0.1:{port}'}}\n"
                    "checkpoints: {pattern: 'ckpt_*.pt', step_regex: 'ckpt_(\\d+)', "
                    "settle_secs: 0.5, poll_secs: 0.5}\n" + _icr_body(tier, 2048, 4096), run_dir=run)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([tier.binary, "watch", "--config", str(cfg)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "DIFFMON_LOG": "info"})
    try:
        shutil.copy(dm.assets.checkpoint, run / "partial")
        os.replace(run / "partial", run / "ckpt_000100.pt")
        deadline = time.monotonic() + 240
        text = ""
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"watch exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                text = ""
            if (_metric(text, "diffmon_checkpoints_evaluated_total") or 0) >= 1:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"no evaluation in 240 s:\n{log.read_text()[-3000:]}")
        peak = _metric(text, "diffmon_gpu_memory_peak_bytes")
        gpu_seconds = _metric(text, "diffmon_gpu_seconds_total")
        time.sleep(1.0)
        held = free_before - torch.cuda.mem_get_info()[0]
        measure(f"evaluation peak {peak / GIB:.2f} GiB reserved, {gpu_seconds:.2f} GPU s; held by "
                f"the idle daemon after it {held / GIB:.2f} GiB (CUDA context, weights, inputs)")
        assert gpu_seconds and gpu_seconds > 0
        assert peak and peak > 2 * GIB, "the evaluation must take gigabytes for the test to mean anything"
        # Kept cached, the peak would still be held, on top of the CUDA context.
        assert held < peak / 2
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_the_memory_cap_sizes_the_batches_and_keeps_the_numbers(dm, tier, tmp_path, measure):
    """``gpu_memory_mib: 1024`` on an evaluation that reserves several GiB without it: the
    reservation stays under the cap, the log says the batch it chose, and ICR is the same to
    float32 rounding (only how many images go through at once changes; cuDNN may pick other
    algorithms for other batch sizes, hence 1e-4 relative rather than equality)."""
    if tier.dry_run:
        pytest.skip("GPU memory only exists on a GPU")
    cap = 1024
    free = dm.eval_json(dm.config(tmp_path / "free.yaml", "cuda", _icr_body(tier, 2048, 4096)))[0]
    capped, out = dm.eval_json(dm.config(tmp_path / "cap.yaml", "cuda",
                                         _icr_body(tier, 2048, 4096, f", gpu_memory_mib: {cap}")))
    chosen = re.search(r"forwarding at most (\d+) images at a time", out.stderr)
    measure(f"peak without a cap {free['gpu_memory_peak_bytes'] / GIB:.2f} GiB, with "
            f"gpu_memory_mib {cap}: {capped['gpu_memory_peak_bytes'] / GIB:.3f} GiB, batch "
            f"{chosen and chosen.group(1)}; icr {capped['icr']:.7f} against {free['icr']:.7f}; "
            f"{capped['seconds']:.2f} s against {free['seconds']:.2f} s")
    assert free["gpu_memory_peak_bytes"] > 2 * cap << 20
    assert chosen, out.stderr[-3000:]
    assert capped["gpu_memory_peak_bytes"] <= cap << 20
    assert abs(capped["icr"] - free["icr"]) <= 1e-4 * abs(free["icr"])


def test_the_share_keeps_the_forward_passes_to_their_share_of_the_time(dm, tier, tmp_path, measure):
    """``gpu_share: 0.25``: the forward passes take at most a quarter (+0.03) of the evaluation's
    wall time, and the evaluation takes what the pauses add to the one at full share: its GPU
    time times (1/share - 1), within 15 %."""
    if tier.dry_run:
        pytest.skip("the share applies to CUDA only")
    full = dm.eval_json(dm.config(tmp_path / "full.yaml", "cuda", _icr_body(tier, 4096, 256)))[0]
    share = 0.25
    body = _icr_body(tier, 4096, 256).replace("gpu_share: 1", f"gpu_share: {share}")
    part = dm.eval_json(dm.config(tmp_path / "part.yaml", "cuda", body))[0]
    duty_full = full["gpu_seconds"] / full["seconds"]
    duty = part["gpu_seconds"] / part["seconds"]
    expected = full["seconds"] - full["gpu_seconds"] + part["gpu_seconds"] / share
    measure(f"gpu_share 1: {full['gpu_seconds']:.2f} GPU s of {full['seconds']:.2f} s "
            f"({duty_full:.2f}); gpu_share {share}: {part['gpu_seconds']:.2f} of "
            f"{part['seconds']:.2f} s ({duty:.3f}), expected {expected:.2f} s")
    assert duty <= share + 0.03
    assert abs(part["seconds"] - expected) <= 0.15 * expected
    assert part["icr"] == pytest.approx(full["icr"], rel=1e-6)
