"""`pip install ./`'s backend wrapper (tools/build-backend/diffmon_build.py), without building:
where it finds torch, which tch release it pins for it (and that the mapping agrees with Cargo.toml,
Cargo.lock, pyproject.toml and the Makefile), what it refuses and says, how it picks the HDF5 and
OpenSSL builds; and that the two pyprojects (`./` and `./python`) describe one distribution. The
real install is `make test-install` (scripts/test-install)."""

import os
import re
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
    assert diffmon_build.check_torch(info) == "0.26.0"  # 2.13.x with lib/ and include/torch


@pytest.mark.parametrize("version, tch", [("2.11.0", "0.24.0"), ("2.11.3+cu130", "0.24.0"),
                                          ("2.12.0", "0.26.0"), ("2.12.1+cu130", "0.26.0"),
                                          ("2.13.0+cpu", "0.26.0"), ("2.13.2", "0.26.0")])
def test_each_supported_torch_gets_its_tch_release(tmp_path, version, tch):
    assert diffmon_build.tch_for_torch(version) == tch
    python = _env_with_torch(tmp_path / "env", version)
    assert diffmon_build.check_torch(diffmon_build.probe_torch(str(python))) == tch


def _assert_names_the_supported(msg: str) -> None:
    assert "torch 2.11.x, 2.12.x or 2.13.x" in msg
    assert "tch 0.24.0 for torch 2.11, tch 0.26.0 for torch 2.12, tch 0.26.0 for torch 2.13" in msg
    assert "libtorch's C++ API and ABI change with every torch release" in msg


@pytest.mark.parametrize("version", ["2.10.0", "2.14.0+cu130", "2.1.3", "3.13.0", "2.13.0a0",
                                     "2.11.0.dev20260101", "2.13"])
def test_other_torch_releases_are_refused_naming_the_supported_ones(tmp_path, version):
    python = _env_with_torch(tmp_path / "env", version)
    info = diffmon_build.probe_torch(str(python))
    with pytest.raises(diffmon_build.BuildError) as e:
        diffmon_build.check_torch(info)
    msg = str(e.value)
    assert f"the environment has torch {version} (" in msg and "not supported" in msg
    _assert_names_the_supported(msg)
    assert "torch==2.13.*" in msg
    with pytest.raises(diffmon_build.BuildError, match="not supported"):
        diffmon_build.tch_for_torch(version)


def test_torch_2_14_and_2_10_are_refused_naming_the_supported():
    for version in ("2.14.0", "2.10.2+cpu"):
        with pytest.raises(diffmon_build.BuildError) as e:
            diffmon_build.tch_for_torch(version)
        _assert_names_the_supported(str(e.value))


def _series_range(spec: str) -> tuple:
    """'>=0.24.0, <0.27.0' or '>=2.11,<2.14' -> ((0, 24), (0, 27))."""
    low = re.search(r">=\s*(\d+)\.(\d+)", spec)
    high = re.search(r"<\s*(\d+)\.(\d+)", spec)
    return (int(low[1]), int(low[2])), (int(high[1]), int(high[2]))


def test_the_mapping_agrees_with_the_manifests():
    """TCH_FOR_TORCH is the one map; Cargo.toml, Cargo.lock, pyproject.toml, the Makefile's default
    torch and its install-test releases agree with it."""
    mapping = diffmon_build.TCH_FOR_TORCH
    assert mapping == {"2.11": "0.24.0", "2.12": "0.26.0", "2.13": "0.26.0"}
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    key = lambda v: tuple(int(p) for p in v.split(".")[:2])  # noqa: E731
    for crate in ("tch", "torch-sys"):
        low, high = _series_range(cargo["dependencies"][crate])
        assert all(low <= key(tch) < high for tch in mapping.values()), crate
        assert low == min(map(key, mapping.values())) and high == (0, max(key(t)[1] for t in mapping.values()) + 1)
    # The lock pins the binding of the project's own torch (the Makefile's default).
    default = re.search(r"^TORCH_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    assert default == "2.13.0"
    pinned = diffmon_build.locked_versions((ROOT / "Cargo.lock").read_text())
    assert pinned == {"tch": mapping["2.13"], "torch-sys": mapping["2.13"]}
    assert diffmon_build.tch_for_torch(default) == mapping["2.13"]
    # pip's dependency range spans exactly the mapped series.
    top = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (dep,) = top["project"]["dependencies"]
    low, high = _series_range(dep)
    series = sorted(map(key, mapping))
    assert low == series[0] and high == (series[-1][0], series[-1][1] + 1)
    # `make test-install` installs one torch per tch release (2.12 shares 2.13's).
    tested = re.search(r"^TEST_INSTALL_TORCH \?= (.+)$", (ROOT / "Makefile").read_text(), re.M)[1]
    releases = {mapping[diffmon_build.torch_series(e.split(":")[0])] for e in tested.split()}
    assert releases == set(mapping.values())
    # Each series in the range has a binding or a reason for having none.
    for minor in range(low[1], high[1]):
        s = f"{low[0]}.{minor}"
        assert (s in mapping) != (s in diffmon_build.TORCH_WITHOUT_TCH), s


LOCK = """# This file is automatically @generated by Cargo.
version = 4

[[package]]
name = "diffmon"
version = "0.1.0"
dependencies = [
 "tch",
 "torch-sys",
]

[[package]]
name = "tch"
version = "{v}"
source = "registry+https://example.invalid/index"

[[package]]
name = "torch-sys"
version = "{v}"
source = "registry+https://example.invalid/index"
"""

# A stand-in cargo: `cargo update -p CRATE --precise V` rewrites both crates' versions (as tch
# pins its torch-sys exactly), logs its arguments, and fails for the version 9.9.9.
FAKE_CARGO = """#!{python}
import re, sys
open("cargo.log", "a").write(" ".join(sys.argv[1:]) + "\\n")
v = sys.argv[sys.argv.index("--precise") + 1]
if v == "9.9.9":
    sys.exit("error: no version 9.9.9")
text = open("Cargo.lock").read()
text = re.sub(r'(name = "(?:tch|torch-sys)"\\nversion = )"[^"]+"', r'\\1"%s"' % v, text)
open("Cargo.lock", "w").write(text)
"""


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "Cargo.lock").write_text(LOCK.format(v="0.26.0"))
    cargo = tmp_path / "cargo"
    cargo.write_text(FAKE_CARGO.format(python=sys.executable))
    cargo.chmod(0o755)
    monkeypatch.setenv("CARGO", str(cargo))
    return root


def test_select_tch_moves_the_lock_and_restore_puts_it_back(checkout):
    before = diffmon_build.select_tch(str(checkout), "0.26.0")
    assert before is None and not (checkout / "cargo.log").exists()  # already pinned: no cargo
    before = diffmon_build.select_tch(str(checkout), "0.24.0")
    assert before == LOCK.format(v="0.26.0")
    assert (checkout / "cargo.log").read_text() == "update -p tch --precise 0.24.0\n"  # torch-sys along
    assert diffmon_build.locked_versions((checkout / "Cargo.lock").read_text()) == {
        "tch": "0.24.0", "torch-sys": "0.24.0"}
    diffmon_build.restore_lock(str(checkout), before)
    assert (checkout / "Cargo.lock").read_text() == LOCK.format(v="0.26.0")


def test_a_failed_cargo_update_leaves_the_lock_as_it_was(checkout):
    with pytest.raises(diffmon_build.BuildError, match="cargo update -p tch --precise 9.9.9"):
        diffmon_build.select_tch(str(checkout), "9.9.9")
    assert (checkout / "Cargo.lock").read_text() == LOCK.format(v="0.26.0")


def test_select_tch_command_line(tmp_path, checkout):
    """`diffmon_build.py select-tch --python P` (make build): probes P's torch, pins its tch."""
    script = BACKEND_DIR / "diffmon_build.py"
    _env_with_torch(tmp_path / "env211", "2.11.0+cu130")
    python = os.path.join("env211", "bin", "python")  # relative, as the Makefile passes .venv/bin/python
    cli = [sys.executable, str(script), "select-tch", "--python", python, "--root", str(checkout)]
    r = subprocess.run(cli, capture_output=True, text=True, env=dict(os.environ), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "torch 2.11.0+cu130: tch 0.24.0; moved Cargo.lock to it" in r.stderr
    assert (checkout / "Cargo.lock").read_text() == LOCK.format(v="0.24.0")  # left there
    old = _env_with_torch(tmp_path / "env210", "2.10.0")
    cli[cli.index(python)] = str(old)
    r = subprocess.run(cli, capture_output=True, text=True, env=dict(os.environ), cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "error: diffmon cannot be built: the environment has torch 2.10.0" in r.stderr
    _assert_names_the_supported(r.stderr)
    assert (checkout / "Cargo.lock").read_text() == LOCK.format(v="0.24.0")  # untouched


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
    assert "install torch 2.11.x, 2.12.x or 2.13.x" in r.stderr
    assert "torch==2.13.*" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("version", ["2.14.0", "2.10.0"])
def test_the_hook_fails_early_on_an_unsupported_torch(tmp_path, version):
    python = _env_with_torch(tmp_path / "env", version)
    r = _hook(python, "get_requires_for_build_wheel", dict(os.environ))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"error: diffmon cannot be built: the environment has torch {version}" in r.stderr
    _assert_names_the_supported(r.stderr)


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
    assert top["project"]["dependencies"] == ["torch>=2.11,<2.14"]
    assert top["tool"]["maturin"]["python-source"] == "python"
    assert top["tool"]["maturin"]["module-name"] == "diffmon"
    assert top["build-system"]["backend-path"] == ["tools/build-backend"]
    # diffmon-export: python/pyproject.toml's entry point, as a script in the binary's wheel.
    assert helpers["project"]["scripts"] == {"diffmon-export": "diffmon.export:main"}
    script = ROOT / top["tool"]["maturin"]["data"] / "scripts" / "diffmon-export"
    text = script.read_text()
    assert text.startswith("#!python\n") and "from diffmon.export import main" in text
    assert os.access(script, os.X_OK)
