"""train_toy.py: data files, model.ts, checkpoint formats, and obeying the stop file."""

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import train_toy

SCRIPT = Path(train_toy.__file__)
TINY = ["--size", "8", "--width", "4", "--train-size", "16", "--heldout-size", "20", "--steps", "4",
        "--ckpt-every", "2", "--batch-size", "8"]


def run(tmp_path, *extra):
    rc = train_toy.main(["--run-dir", str(tmp_path), *TINY, *extra])
    assert rc == 0
    return tmp_path


def images(path):
    with h5py.File(path, "r") as f:
        return f["images"][()], f["index"][()]


def test_data_files_and_model(tmp_path):
    run(tmp_path)
    train, ti = images(tmp_path / "train.h5")
    held, hi = images(tmp_path / "heldout.h5")
    assert train.dtype == np.float32 and train.shape == (16, 1, 8, 8)
    assert held.dtype == np.float32 and held.shape == (20, 1, 8, 8)
    for x in (train, held):
        assert x.min() >= -1 and x.max() <= 1 and x.min() < -0.99 and x.max() > 0.99
    assert not set(ti) & set(hi)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt_000002.pt", "ckpt_000004.pt", "heldout.h5", "model.ts", "train.h5"]

    arch = torch.jit.load(str(tmp_path / "model.ts"))
    sd = torch.load(tmp_path / "ckpt_000004.pt", weights_only=True)
    assert type(sd) is OrderedDict
    assert list(sd.keys()) == list(arch.state_dict().keys())
    assert "norm_in.running_mean" in sd and "embed.freqs" in sd
    assert not torch.equal(sd["norm_in.running_var"], torch.ones_like(sd["norm_in.running_var"]))
    arch.load_state_dict(sd)
    d, f = arch(torch.from_numpy(train[:3]), torch.tensor([0.1, 0.29, 2.0]))
    assert d.shape == (3, 1, 8, 8) and f.shape == (3, 8, 2, 2)


def test_model_out_puts_the_architecture_beside_the_run(tmp_path):
    # A sweep's runs share one architecture beside them: nothing but data and checkpoints in
    # the run folder, so the watcher has no extra file to warn about.
    shared = tmp_path / "sweep" / "model.ts"
    run(tmp_path / "sweep" / "lr-1", "--model-out", str(shared))
    names = sorted(p.name for p in (tmp_path / "sweep" / "lr-1").iterdir())
    assert names == ["ckpt_000002.pt", "ckpt_000004.pt", "heldout.h5", "train.h5"]
    arch = torch.jit.load(str(shared))
    arch.load_state_dict(torch.load(tmp_path / "sweep" / "lr-1" / "ckpt_000004.pt", weights_only=True))
    assert sorted(p.name for p in shared.parent.iterdir()) == ["lr-1", "model.ts"]


def test_default_size_is_16_and_split_is_seeded(tmp_path):
    a = run(tmp_path / "a", "--size", "16")
    b = run(tmp_path / "b", "--size", "16")
    c = run(tmp_path / "c", "--size", "16", "--seed", "1")
    xa, ia = images(a / "train.h5")
    assert xa.shape == (16, 1, 16, 16) and xa.min() >= -1 and xa.max() <= 1
    assert np.array_equal(ia, images(b / "train.h5")[1])
    assert not np.array_equal(ia, images(c / "train.h5")[1])
    with h5py.File(a / "heldout.h5") as f:
        assert f["images"].shape == (20, 1, 16, 16)
    assert train_toy.parse_args(["--run-dir", "x"]).size == 16


def test_heldout_defaults_to_all_remaining_images(tmp_path):
    train_toy.main(["--run-dir", str(tmp_path), "--size", "8", "--width", "4", "--train-size", "64",
                    "--steps", "1", "--ckpt-every", "1", "--batch-size", "4"])
    _, ti = images(tmp_path / "train.h5")
    _, hi = images(tmp_path / "heldout.h5")
    assert len(ti) == 64 and len(hi) == 1797 - 64
    assert sorted(set(ti) | set(hi)) == list(range(1797))


def test_ema_dict_format(tmp_path):
    run(tmp_path, "--format", "ema_dict", "--ema", "0.9")
    ck = torch.load(tmp_path / "ckpt_000004.pt", weights_only=True)
    assert set(ck) == {"ema", "model", "step"} and ck["step"] == 4
    assert list(ck["ema"].keys()) == list(ck["model"].keys())
    k = "conv_in.weight"
    assert not torch.equal(ck["ema"][k], ck["model"][k])
    torch.jit.load(str(tmp_path / "model.ts")).load_state_dict(ck["ema"])


def test_safetensors_format(tmp_path):
    from safetensors.torch import load_file

    run(tmp_path, "--format", "safetensors")
    sd = load_file(str(tmp_path / "ckpt_000002.safetensors"))
    arch = torch.jit.load(str(tmp_path / "model.ts"))
    assert set(sd) == set(arch.state_dict())
    arch.load_state_dict(sd)


def test_torchscript_format(tmp_path):
    run(tmp_path, "--format", "torchscript")
    ck = torch.jit.load(str(tmp_path / "ckpt_000004.ts"))
    d, f = ck(torch.zeros(2, 1, 8, 8), torch.tensor([0.5, 1.0]))
    assert d.shape == (2, 1, 8, 8) and f.shape == (2, 8, 2, 2)
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_stops_when_the_stop_file_appears(tmp_path, monkeypatch, capsys):
    real_save = train_toy.save_checkpoint

    def save_then_fire(run_dir, *args, **kwargs):
        path = real_save(run_dir, *args, **kwargs)
        (run_dir / "MY_STOP").write_text(json.dumps({"event": "early_stop", "best_step": 2,
                                                     "best_checkpoint": path.name}))
        return path

    monkeypatch.setattr(train_toy, "save_checkpoint", save_then_fire)
    train_toy.main(["--run-dir", str(tmp_path), *TINY, "--steps", "10", "--stop-file", "MY_STOP"])
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000002.pt"]
    assert "stopping at step 2" in capsys.readouterr().out


def test_cli_obeys_a_pre_existing_stop_file(tmp_path):
    (tmp_path / "EARLY_STOP").write_text(json.dumps({"event": "early_stop", "best_step": 100}))
    p = subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(tmp_path), *TINY],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "stopping" in p.stdout and not list(tmp_path.glob("ckpt_*"))


def test_bad_arguments_exit_2(tmp_path):
    with pytest.raises(SystemExit) as e:
        train_toy.parse_args(["--run-dir", str(tmp_path), "--format", "pickle"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        train_toy.main(["--run-dir", str(tmp_path), "--train-size", "2000"])
    assert e.value.code == 2 and not list(tmp_path.iterdir())


def test_a_resumed_run_trains_exactly_as_an_uninterrupted_one(tmp_path, capsys):
    straight = run(tmp_path / "straight", "--resumable", "--ema", "0.9", "--format", "ema_dict",
                   "--steps", "6")
    resumed = run(tmp_path / "resumed", "--resumable", "--ema", "0.9", "--format", "ema_dict")
    assert sorted(p.name for p in resumed.glob("ckpt_*")) == ["ckpt_000002.pt", "ckpt_000004.pt"]
    run(resumed, "--resumable", "--ema", "0.9", "--format", "ema_dict", "--steps", "6")
    assert "resuming" in capsys.readouterr().out
    a = torch.load(straight / "ckpt_000006.pt", weights_only=True)
    b = torch.load(resumed / "ckpt_000006.pt", weights_only=True)
    for key in ("ema", "model"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    # Settings that differ from the saved run's are refused, naming them.
    with pytest.raises(SystemExit, match="--width 4 \\(now 5\\)"):
        run(resumed, "--resumable", "--ema", "0.9", "--format", "ema_dict", "--steps", "8",
            "--width", "5")
