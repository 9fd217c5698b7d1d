"""`pip install ./`'s backend wrapper (tools/build-backend/diffmon_build.py), without building:
where it finds torch, what it refuses and says, how it picks the HDF5 and OpenSSL builds; and that the two
pyprojects (`./` and `./python`) describe one distribution. The real install is
`make test-install` (scripts/test-install)."""

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKEND_DIR = ROOT / "tools" / "build-backend"
sys.path.insert(0, str(BACKEND_DIR))
import diffmon_build  # noqa: E402

FAKE_TORCH = """
__version__ = {version!r}
class _C:
    _GLIBCXX_USE_CXX11_ABI = {abi!r}
class version:
    cuda = None
"""


def _env_with_torch(root: Path, version: str, abi: bool = True) -> Path:
    """A virtual environment (no pip) whose site-packages holds a stand-in torch package."""
    venv.create(root, with_pip=False)
    python = root / "bin" / "python"
    site = subprocess.run([python, "-E", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    pkg = Path(site) / "torch"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "include" / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TORCH.format(version=version, abi=abi))
    return python


def _overlay(tmp_path: Path, version: str) -> dict:
    """An environment like pip's build isolation: PYTHONPATH puts another torch first."""
    over = tmp_path / "overlay"
    (over / "torch").mkdir(parents=True)
    (over / "torch" / "__init__.py").write_text(FAKE_TORCH.format(version=version, abi=False))
    return {**os.environ, "PYTHONPATH": str(over)}


def test_probe_asks_the_interpreter_outside_the_pythonpath_overlay(tmp_path, monkeypatch):
    python = _env_with_torch(tmp_path / "env", "2.13.0+cu130", abi=True)
    for k, v in _overlay(tmp_path, "9.9.9").items():
        monkeypatch.setenv(k, v)
    info = diffmon_build.probe_torch(str(python))
    assert info["version"] == "2.13.0+cu130"
    assert info["cxx11_abi"] is True
    assert Path(info["dir"]).resolve().is_relative_to((tmp_path / "env").resolve())
    diffmon_build.check_torch(info)  # 2.13.x with lib/ and include/torch: accepted


@pytest.mark.parametrize("version", ["2.12.1+cpu", "2.14.0", "2.1.3", "3.13.0"])
def test_other_torch_releases_are_refused_naming_2_13_and_tch(tmp_path, version):
    python = _env_with_torch(tmp_path / "env", version)
    info = diffmon_build.probe_torch(str(python))
    with pytest.raises(diffmon_build.BuildError) as e:
        diffmon_build.check_torch(info)
    msg = str(e.value)
    assert version in msg and "2.13" in msg and "tch 0.26" in msg


def _hook(python: Path, hook: str, env: dict) -> subprocess.CompletedProcess:
    code = (f"import sys; sys.path.insert(0, {str(BACKEND_DIR)!r}); import diffmon_build; "
            f"print(diffmon_build.{hook}())")
    return subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)


def test_the_hook_fails_early_with_a_message_when_torch_is_missing(tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    env = _overlay(tmp_path, "2.13.0")  # pip's overlay torch must not count
    env.pop("VIRTUAL_ENV", None)
    env.pop("CONDA_PREFIX", None)
    r = _hook(env_dir / "bin" / "python", "get_requires_for_build_wheel", env)
    assert r.returncode == 1, r
    assert "error: diffmon cannot be built: torch is not importable" in r.stderr
    assert "torch==2.13.*" in r.stderr and "Traceback" not in r.stderr


def test_the_hook_fails_early_on_torch_2_12(tmp_path):
    python = _env_with_torch(tmp_path / "env", "2.12.0")
    r = _hook(python, "get_requires_for_build_wheel", dict(os.environ))
    assert r.returncode == 1
    assert "torch 2.12.0" in r.stderr and "needs torch 2.13.x" in r.stderr


def test_missing_cargo_and_compilers_are_named(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for var in ("CARGO", "CC", "CXX"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(diffmon_build.BuildError, match="cargo .*rustup"):
        diffmon_build.check_toolchain()
    (empty / "cargo").symlink_to("/bin/true")
    with pytest.raises(diffmon_build.BuildError, match=r"no C\+\+ or C compiler"):
        diffmon_build.check_toolchain()
    for name in ("c++", "cc"):
        (empty / name).symlink_to("/bin/true")
    diffmon_build.check_toolchain()


def test_hdf5_mode(tmp_path, monkeypatch):
    no_pkg_config = tmp_path / "bin"
    no_pkg_config.mkdir()
    monkeypatch.setenv("PATH", str(no_pkg_config))
    monkeypatch.delenv("HDF5_DIR", raising=False)
    monkeypatch.setattr(diffmon_build, "HDF5_DEFAULT_INCLUDE_DIRS", (str(tmp_path / "inc"),))
    monkeypatch.delenv("DIFFMON_HDF5", raising=False)
    assert diffmon_build.hdf5_mode()[0] == "static"  # nothing found: built from source
    (tmp_path / "inc").mkdir()
    (tmp_path / "inc" / "hdf5.h").write_text("")
    assert diffmon_build.hdf5_mode() == ("system", f"found {tmp_path / 'inc'}")
    monkeypatch.setenv("DIFFMON_HDF5", "static")
    assert diffmon_build.hdf5_mode()[0] == "static"  # asked for
    monkeypatch.setenv("DIFFMON_HDF5", "auto")
    monkeypatch.setattr(diffmon_build, "HDF5_DEFAULT_INCLUDE_DIRS", ())
    monkeypatch.setenv("HDF5_DIR", str(tmp_path))
    assert diffmon_build.hdf5_mode()[0] == "system"
    monkeypatch.setenv("DIFFMON_HDF5", "shared")
    with pytest.raises(diffmon_build.BuildError, match="auto, system, static"):
        diffmon_build.hdf5_mode()


def test_openssl_mode(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # no pkg-config, no perl, no make
    for var in ("OPENSSL_DIR", "OPENSSL_INCLUDE_DIR", "DIFFMON_OPENSSL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(diffmon_build, "OPENSSL_PREFIXES", (str(tmp_path / "ssl"),))
    with pytest.raises(diffmon_build.BuildError, match="perl .*make.*libssl-dev"):
        diffmon_build.openssl_mode()  # nothing found, nothing to build it with
    for tool in ("perl", "make"):
        real = shutil.which(tool, path="/usr/bin:/bin")
        if real is None:
            pytest.skip(f"no {tool} here")
        (bin_dir / tool).symlink_to(real)
    assert diffmon_build.openssl_mode()[0] == "vendored"
    (tmp_path / "ssl" / "include" / "openssl").mkdir(parents=True)
    (tmp_path / "ssl" / "include" / "openssl" / "opensslv.h").write_text("")
    assert diffmon_build.openssl_mode() == ("system", "found its headers")
    monkeypatch.setenv("DIFFMON_OPENSSL", "vendored")
    assert diffmon_build.openssl_mode()[0] == "vendored"
    monkeypatch.setenv("DIFFMON_OPENSSL", "static")
    with pytest.raises(diffmon_build.BuildError, match="auto, system, vendored"):
        diffmon_build.openssl_mode()


def test_the_features_reach_maturin(monkeypatch):
    monkeypatch.setenv("MATURIN_PEP517_ARGS", "--quiet")
    assert diffmon_build._with_features(None, ["static-hdf5", "vendored-openssl"]) is None
    assert os.environ["MATURIN_PEP517_ARGS"] == "--quiet --features static-hdf5,vendored-openssl"
    cs = diffmon_build._with_features({"build-args": "-v"}, ["static-hdf5"])
    assert cs == {"build-args": ["-v", "--features", "static-hdf5"]}
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert cargo["features"]["static-hdf5"] == ["hdf5/static", "hdf5/zlib"]
    assert cargo["features"]["vendored-openssl"] == ["reqwest/native-tls-vendored"]


def test_the_two_pyprojects_are_one_distribution():
    top = tomllib.loads((ROOT / "pyproject.toml").read_text())
    helpers = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    # Same name and version: installing one replaces the other, never two owners of diffmon/.
    assert top["project"]["name"] == helpers["project"]["name"] == "diffmon"
    assert top["project"]["dynamic"] == ["version"]  # maturin takes Cargo.toml's
    import diffmon
    assert cargo["package"]["version"] == helpers["project"]["version"] == diffmon.__version__
    assert top["project"]["optional-dependencies"] == helpers["project"]["optional-dependencies"]
    assert top["project"]["dependencies"] == ["torch>=2.13,<2.14"]
    assert top["tool"]["maturin"]["python-source"] == "python"
    assert top["tool"]["maturin"]["module-name"] == "diffmon"
    assert top["build-system"]["backend-path"] == ["tools/build-backend"]
    # diffmon-export: python/pyproject.toml's entry point, as a script in the binary's wheel.
    assert helpers["project"]["scripts"] == {"diffmon-export": "diffmon.export:main"}
    script = ROOT / top["tool"]["maturin"]["data"] / "scripts" / "diffmon-export"
    text = script.read_text()
    assert text.startswith("#!python\n") and "from diffmon.export import main" in text
    assert os.access(script, os.X_OK)
