"""diffmon-export's compile step, the parts that need no compile (tests/integration/compiled.rs
compiles a package once and checks it end to end: export, compile, daemon)."""

import argparse
import platform

import pytest
import torch

from diffmon import compile as compiling
from diffmon.export import main


def test_compile_goes_with_a_denoiser_only():
    with pytest.raises(SystemExit) as e:
        main(["--factory", "x:y", "--vae", "--shape", "3", "8", "8", "--out", "v.ts", "--compile"])
    assert e.value.code == 2


def test_the_flags_become_the_compile_options_and_the_rebuild_command(monkeypatch):
    ap = argparse.ArgumentParser()
    compiling.add_arguments(ap)
    argv = ["--compile", "--compile-precision", "bf16", "--compile-min-batch", "64"]
    monkeypatch.delenv("PYTHONPATH", raising=False)
    opts = compiling.options(ap.parse_args(argv), ["--factory", "m:f", "--out", "a b.ts", *argv])
    assert opts == {"device": "cpu", "precision": "bf16", "min_batch": 64,
                    "rebuild": "diffmon-export --factory m:f --out 'a b.ts' --compile "
                               "--compile-precision bf16 --compile-min-batch 64"}
    assert compiling.options(ap.parse_args([]), []) is None
    # The PYTHONPATH that made the factory importable is part of the command.
    monkeypatch.setenv("PYTHONPATH", "my code")
    opts = compiling.options(ap.parse_args(argv), ["--factory", "m:f", *argv])
    assert opts["rebuild"].startswith("PYTHONPATH='my code' diffmon-export --factory m:f --compile")


def test_bad_arguments_are_refused_before_anything_is_compiled(tmp_path):
    net = torch.nn.Identity()
    with pytest.raises(ValueError, match="precision"):
        compiling.compile_contract(net, tmp_path / "m.ts", (1, 4, 4), "cpu", precision="fp16")
    with pytest.raises(ValueError, match="min_batch"):
        compiling.compile_contract(net, tmp_path / "m.ts", (1, 4, 4), "cpu", min_batch=1)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/cpuinfo")
def test_the_cpu_flags_are_instruction_sets_of_this_cpu():
    flags = compiling.cpu_isa_flags()
    text = open("/proc/cpuinfo").read()
    assert flags and all(f" {f}" in text for f in flags)
    if platform.machine() == "x86_64":
        assert "sse2" in flags and "hypervisor" not in flags
    assert compiling.sidecar_path(compiling.Path("a/m.pt2")) == compiling.Path("a/m.pt2.json")


def test_a_loader_that_crashes_in_the_probe_is_an_error_that_says_so(tmp_path):
    """The package runs in a child process (libtorch's AOTInductor loader segfaulted on CUDA
    packages on torch 2.11 in the GPU tier): a child killed by a signal, or one that fails, is a
    RuntimeError naming what happened, and the exporter's process lives on."""
    import sys

    case = (torch.zeros(2, 1, 4, 4), torch.ones(2))
    crash = [sys.executable, "-X", "faulthandler", "-c",
             "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(RuntimeError, match=r"loader crashed \(SIGSEGV\) at File \"<string>\", "
                                           r"line 1 in <module> on the package"):
        compiling.probe_package(tmp_path / "m.pt2", "cpu", [case], case, {}, child=crash)
    fail = [sys.executable, "-c", "raise SystemExit('no such package')"]
    with pytest.raises(RuntimeError, match="failed .exit 1: no such package"):
        compiling.probe_package(tmp_path / "m.pt2", "cpu", [case], case, {}, child=fail)


def test_the_weights_are_taken_out_of_the_package(tmp_path):
    """The package Inductor writes with its weights on disk (``pickle_weights``: a pickle a
    tensor and a ``weights_config.json`` of name, file, shape, stride, offset) is rewritten
    without them, every other entry unchanged, and the tensors come back by their names in the
    package (a view of a shared pickle included)."""
    import io
    import json
    import zipfile

    def pickled(t):
        b = io.BytesIO()
        torch.save(t, b)
        return b.getvalue()

    pkg = tmp_path / "m.pt2"
    whole = torch.arange(12, dtype=torch.float32)
    config = {"l.weight": ["weight_0", [2, 3], [3, 1], 0],
              "_tensor_constant0": ["weight_0", [4], [1], 8],
              "l.bias": ["weight_1", [3], [1], 0]}
    kernels = b"\x7fELF not really"
    with zipfile.ZipFile(pkg, "w") as z:
        z.writestr("m/data/aotinductor/model/x.wrapper.so", kernels)
        z.writestr("m/data/aotinductor/model/weights_config.json", json.dumps(config))
        z.writestr("m/data/weights/weight_0", pickled(whole))
        z.writestr("m/data/weights/weight_1", pickled(torch.ones(3)))
        z.writestr("m/archive_format", "pt2")
    held = compiling._take_out_weights(pkg)
    assert sorted(held) == sorted(config)
    assert torch.equal(held["l.weight"], whole[:6].reshape(2, 3))
    assert torch.equal(held["_tensor_constant0"], whole[8:12])
    assert torch.equal(held["l.bias"], torch.ones(3))
    with zipfile.ZipFile(pkg) as z:
        assert z.namelist() == ["m/data/aotinductor/model/x.wrapper.so", "m/archive_format"]
        assert z.read("m/data/aotinductor/model/x.wrapper.so") == kernels
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt2"]


def test_the_constants_file_is_what_the_sidecar_says(tmp_path):
    import hashlib

    assert compiling._write_constants({}, tmp_path / "t") is None
    assert not (tmp_path / "t").exists()
    table = torch.linspace(0, 1, 5, dtype=torch.float64)
    note = compiling._write_constants({"_tensor_constant0": table}, tmp_path / "t")
    assert note == {"sha256": hashlib.sha256((tmp_path / "t").read_bytes()).hexdigest(),
                    "tensors": {"_tensor_constant0": {"dtype": "float64", "shape": [5]}}}
    assert torch.equal(torch.load(tmp_path / "t", weights_only=True)["_tensor_constant0"], table)
