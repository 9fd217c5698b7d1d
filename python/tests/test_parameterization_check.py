"""The daemon's parameterization check (#62, docs/guide/model-contract.md): a velocity network
exported from its constructor as ``eps`` (the exporter has no trained weights to check) is
caught on the first trained checkpoint, by ``diffmon eval`` and by ``diffmon watch`` (console,
live page, ``check-config``); the same checkpoint under its own parameterization is not."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

import flow_toy

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "diffmon"
SAID = "parameterization is probably not the one it was exported with (`eps`)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The flow toy trained 150 steps on 64 digits (8x8), exported right (``model.ts``) and, from
    its constructor, as ``eps`` (``wrong.ts``)."""
    if not BIN.is_file():
        pytest.fail(f"{BIN} is missing: run `make setup` first")
    d = tmp_path_factory.mktemp("flow")
    assert flow_toy.main(["--run-dir", str(d), "--size", "8", "--width", "16", "--train-size", "64",
                          "--heldout-size", "64", "--steps", "150", "--ckpt-every", "150",
                          "--batch-size", "32"]) == 0
    flow_toy.export(flow_toy.make_model("unet", 16, 8), flow_toy.feature_layer(flow_toy.make_model("unet", 16, 8)),
                    d / "wrong.ts", "eps", example_shape=(1, 1, 8, 8))
    return d


def config(d: Path, arch: str, port: int = 0) -> Path:
    port = port or free_port()
    cfg = d / f"{arch}.yaml"
    cfg.write_text(f"run: {{dir: ., name: {arch}}}\nmodel: {{architecture: {arch}.ts}}\ndevice: cpu\n"
                   f"data: {{path: train.h5}}\nicr: {{samples: 64, batch_size: 64}}\nstate_dir: state-{arch}\n"
                   f"http: {{listen: 127.0.0.1:{port}}}\ncheckpoints: {{pattern: 'ckpt_*.pt', settle_secs: 0.2, poll_secs: 0.5}}\n")
    return cfg


def diffmon(*args, cwd):
    return subprocess.run([str(BIN), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_eval_warns_on_the_wrong_parameterization_only(run):
    wrong = diffmon("eval", "--config", str(config(run, "wrong")), str(run / "ckpt_000150.pt"), cwd=run)
    assert wrong.returncode == 0, wrong.stderr
    assert "WARN" in wrong.stderr and SAID in wrong.stderr and "--scheduler" in wrong.stderr, wrong.stderr
    right = diffmon("eval", "--config", str(config(run, "model")), str(run / "ckpt_000150.pt"), cwd=run)
    assert right.returncode == 0, right.stderr
    assert "parameterization check" not in right.stderr, right.stderr


def test_watch_says_it_on_the_console_the_page_and_in_check_config(run):
    port = free_port()
    cfg = config(run, "wrong", port)
    log = open(run / "watch.log", "w")
    watch = subprocess.Popen([str(BIN), "watch", "--config", str(cfg)], cwd=run, stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        page = ""
        while 'id="parameterization"' not in page:
            assert watch.poll() is None and time.monotonic() < deadline, (run / "watch.log").read_text()
            time.sleep(0.5)
            try:
                page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            except OSError:
                pass
        assert "parameterization check (step 150)" in page and "probably not the one" in page
    finally:
        watch.terminate()
        watch.wait(timeout=120)
        log.close()
    text = (run / "watch.log").read_text()
    assert text.count(SAID) == 1, text
    kept = json.loads((run / "state-wrong" / "parameterization.json").read_text())
    assert kept["step"] == 150 and SAID in kept["warning"]
    checked = diffmon("check-config", str(cfg), cwd=run)
    assert checked.returncode == 0, checked.stderr
    assert "parameterization check on step 150" in checked.stdout and "(warning)" in checked.stdout, checked.stdout
    # Exported again right under the same state folder: the next start checks, passes, and the
    # warning is gone from the state folder and check-config.
    os.replace(run / "model.ts", run / "wrong.ts")
    (run / "ckpt_000150.pt").rename(run / "ckpt_000300.pt")
    watch = subprocess.Popen([str(BIN), "watch", "--config", str(cfg)], cwd=run, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while (run / "state-wrong" / "parameterization.json").exists():
            assert watch.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
    finally:
        watch.terminate()
        watch.wait(timeout=120)
    checked = diffmon("check-config", str(cfg), cwd=run)
    assert "parameterization check" not in checked.stdout, checked.stdout
