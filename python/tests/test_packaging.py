"""`pip install ./python`: the wheel builds offline, installs the `diffmon-export` entry point and a
`diffmon` package that works from the install, not from the source tree."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]


def test_wheel_installs_entry_point_and_package(tmp_path):
    # Build from a copy: an in-tree build would leave build/ and *.egg-info in python/.
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(PYTHON_DIR / f, src / f)
    shutil.copytree(PYTHON_DIR / "diffmon", src / "diffmon",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PIP_NO_INDEX"] = "1"  # nothing may come from the network
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                   check=True, env=env, cwd=tmp_path)
    wheels = list((tmp_path / "dist").glob("diffmon-*.whl"))
    assert len(wheels) == 1, wheels
    target = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheels[0])],
                   check=True, env=env, cwd=tmp_path)

    env["PYTHONPATH"] = str(target)
    exe = target / "bin" / "diffmon-export"
    assert exe.is_file()
    out = subprocess.run([str(exe), "--help"], check=True, env=env, cwd=tmp_path,
                         capture_output=True, text=True).stdout
    assert out.startswith("usage: diffmon-export")
    assert "diffusers:UNet2DModel.from_pretrained" in out and "--weights" in out

    code = ("import diffmon, diffmon.stop as s; print(diffmon.__file__); "
            "print(s.should_stop('.'), diffmon.__version__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path,
                         capture_output=True, text=True).stdout.split("\n")
    assert Path(out[0]).resolve().is_relative_to(target.resolve()), out
    assert out[1] == "False 0.1.0"
