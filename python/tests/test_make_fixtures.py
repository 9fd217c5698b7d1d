"""make_fixtures.py: every fixture is there, small, consistent, and the broken ones are broken."""

import io
import json
import pickletools
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import make_fixtures

SCRIPT = Path(make_fixtures.__file__)
EXPECTED = {
    "arch.ts", "ckpt_state_dict.pt", "ckpt_ema.pt", "ckpt_module_prefix.pt", "ckpt.safetensors",
    "ckpt.ts", "reference.h5", "ckpt_truncated.pt", "ckpt_zero.pt", "ckpt_evil.pt",
    "ckpt_wrong_shape.pt", "ckpt_missing_keys.pt", "data_f32.h5", "data_u8_nhwc.h5",
    "data_u8_nchw.h5", "manifest.json",
}


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixtures")
    p = subprocess.run([sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("wrote ")
    return out


def load_weights(path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    obj = torch.load(path, weights_only=True)
    if "ema" in obj:
        obj = obj["ema"]
    return OrderedDict((k.removeprefix("module."), v) for k, v in obj.items())


def test_all_files_small(fx):
    assert {p.name for p in fx.iterdir()} == EXPECTED
    assert sum(p.stat().st_size for p in fx.iterdir()) < 800_000


def test_every_checkpoint_format_reproduces_the_reference(fx):
    with h5py.File(fx / "reference.h5") as f:
        x, sigma = torch.from_numpy(f["x"][()]), torch.from_numpy(f["sigma"][()])
        want_d, want_f = torch.from_numpy(f["denoised"][()]), torch.from_numpy(f["features"][()])
    assert x.shape == (4, 1, 16, 16) and sigma.shape == (4,) and want_f.shape[0] == 4
    arch = torch.jit.load(str(fx / "arch.ts"))
    d0, _ = arch(x, sigma)
    assert float((d0 - want_d).abs().max()) > 1e-3  # arch.ts alone holds other weights
    for name in ("ckpt_state_dict.pt", "ckpt_ema.pt", "ckpt_module_prefix.pt", "ckpt.safetensors"):
        m = torch.jit.load(str(fx / "arch.ts"))
        m.load_state_dict(load_weights(fx / name))
        d, f = m(x, sigma)
        assert torch.allclose(d, want_d, atol=1e-5) and torch.allclose(f, want_f, atol=1e-5), name
    d, f = torch.jit.load(str(fx / "ckpt.ts"))(x, sigma)
    assert torch.allclose(d, want_d, atol=1e-5) and torch.allclose(f, want_f, atol=1e-5)


def test_checkpoint_layouts(fx):
    sd = torch.load(fx / "ckpt_state_dict.pt", weights_only=True)
    assert type(sd) is OrderedDict
    rm, rv = sd["norm_in.running_mean"], sd["norm_in.running_var"]
    assert rm.abs().max() > 1e-3 and (rv - 1).abs().max() > 1e-3  # non-default statistics
    ema = torch.load(fx / "ckpt_ema.pt", weights_only=True)
    assert set(ema) == {"ema", "step"} and ema["step"] == 7
    pre = torch.load(fx / "ckpt_module_prefix.pt", weights_only=True)
    assert all(k.startswith("module.") for k in pre)
    a = torch.jit.load(str(fx / "arch.ts")).state_dict()
    assert not torch.equal(a["embed.freqs"], sd["embed.freqs"])
    assert not torch.equal(a["norm_in.running_mean"], rm)


def test_broken_checkpoints(fx):
    full = (fx / "ckpt_state_dict.pt").read_bytes()
    assert (fx / "ckpt_truncated.pt").read_bytes() == full[: len(full) // 2]
    assert (fx / "ckpt_zero.pt").stat().st_size == 0
    manifest = json.loads((fx / "manifest.json").read_text())
    missing = torch.load(fx / "ckpt_missing_keys.pt", weights_only=True)
    sd = torch.load(fx / "ckpt_state_dict.pt", weights_only=True)
    assert set(sd) - set(missing) == {manifest["missing_key"]}
    wrong = torch.load(fx / "ckpt_wrong_shape.pt", weights_only=True)
    assert set(wrong) == set(sd) and wrong["conv_in.weight"].shape != sd["conv_in.weight"].shape
    for name in ("ckpt_truncated.pt", "ckpt_zero.pt"):
        with pytest.raises(Exception):
            torch.load(fx / name, weights_only=True)


def test_evil_pickle_is_malicious_shaped_and_refused(fx):
    path = fx / "ckpt_evil.pt"
    with zipfile.ZipFile(path) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        ops = list(pickletools.genops(io.BytesIO(z.read(pkl))))
    strings = [str(arg) for _, arg, _ in ops if arg is not None]
    assert any(op.name in ("GLOBAL", "STACK_GLOBAL") for op, _, _ in ops)
    assert any("system" in s for s in strings) and any("PWNED" in s and "touch" in s for s in strings)
    assert any(op.name == "REDUCE" for op, _, _ in ops)
    with pytest.raises(Exception, match="(?i)weights.only|unsupported global|system"):
        torch.load(path, weights_only=True)
    assert not (fx / "PWNED").exists()


def test_image_layouts_convert_to_the_same_floats(fx):
    with h5py.File(fx / "data_f32.h5") as f:
        f32, expected = f["images"][()], f["expected"][()]
    with h5py.File(fx / "data_u8_nhwc.h5") as f:
        nhwc = f["images"][()]
    with h5py.File(fx / "data_u8_nchw.h5") as f:
        nchw = f["images"][()]
    assert f32.dtype == np.float32 and f32.shape == (10, 1, 16, 16)
    assert nhwc.dtype == np.uint8 and nhwc.shape == (10, 16, 16, 1)
    assert nchw.dtype == np.uint8 and nchw.shape == (10, 1, 16, 16)
    assert np.array_equal(nhwc.transpose(0, 3, 1, 2), nchw)
    assert nchw.min() == 0 and nchw.max() == 255 and len(np.unique(nchw)) > 50
    conv = nchw.astype(np.float32) / np.float32(127.5) - np.float32(1)
    assert np.array_equal(conv, expected) and np.array_equal(f32, expected)
    assert expected.min() == -1 and expected.max() == 1


def test_deterministic(fx, tmp_path):
    make_fixtures.main([str(tmp_path)])
    for name in ("reference.h5",):
        with h5py.File(fx / name) as a, h5py.File(tmp_path / name) as b:
            for k in a:
                assert np.array_equal(a[k][()], b[k][()])
    for name in ("ckpt_state_dict.pt", "ckpt_wrong_shape.pt"):
        a, b = torch.load(fx / name, weights_only=True), torch.load(tmp_path / name, weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a)
