"""PEP 517 backend for `pip install ./`: maturin, told where the environment's torch is.

diffmon links against libtorch, and the libtorch it must link against is the one of the torch
package installed in the environment pip installs into. pip builds in an isolated environment
that hides that torch from the backend (its PYTHONPATH overlay), so this wrapper asks the target
interpreter itself, `sys.executable -E` (which ignores the overlay), where torch is, checks it,
and sets for the cargo build:

    LIBTORCH              the torch package folder (torch-sys reads include/ and lib/ there;
                          build.rs embeds lib/ as the binary's rpath)
    LIBTORCH_CXX11_ABI    torch._C._GLIBCXX_USE_CXX11_ABI

These override `.cargo/config.toml`'s values, which are not forced.

torch 2.11.x, 2.12.x and 2.13.x are supported. libtorch's C++ API and ABI change with every torch
release, and each release of diffmon's libtorch binding (the tch and torch-sys crates) is
generated for one: tch 0.24 for torch 2.11, tch 0.26 for torch 2.13 (TCH_FOR_TORCH below).
torch 2.12's own, tch 0.25, was never published on the crate registry; 2.12 builds with tch 0.26,
whose C++ wrappers compile against torch 2.12's headers unchanged. Cargo.toml accepts that range of tch; Cargo.lock pins 0.26 (the project's own torch
2.13.0). Before maturin runs cargo, the build moves Cargo.lock to the release that matches the
environment's torch (`cargo update -p tch --precise X`, torch-sys along) and puts the file back
as it was when the build ends, so the checkout is left as it was (the build's own `target/` aside).

It fails early, with a message saying what to do, when torch is missing or another release
(naming the supported ones), or when cargo or a C/C++ compiler is missing.

HDF5: DIFFMON_HDF5=auto (the default) links the system's HDF5 when the build can find it (HDF5_DIR,
pkg-config's `hdf5`, or the Debian/RHEL header folders hdf5-metno-sys looks in) and otherwise
builds HDF5 from source (cargo feature `static-hdf5`, with cmake from PyPI when none is on PATH);
DIFFMON_HDF5=static or DIFFMON_HDF5=system forces one. OpenSSL likewise: DIFFMON_OPENSSL=auto links
the system's when its headers are found (OPENSSL_DIR, pkg-config's `openssl`, the folders
openssl-sys looks in) and otherwise builds it from source (cargo feature `vendored-openssl`,
which needs perl and make); `system` or `vendored` forces one. DIFFMON_PYTHON names another interpreter
whose torch to use (for frontends that build in a separate virtual environment).

Everything else is maturin's (tool.maturin in pyproject.toml).

From the command line (the Makefile's `make build` runs it before `cargo build --locked`):

    python tools/build-backend/diffmon_build.py select-tch [--python .venv/bin/python]

probes that interpreter's torch, refuses an unsupported one with the same message, and moves
Cargo.lock to the matching tch release, leaving it there (the checkout is then set up for that
torch; `make setup` with the default TORCH_VERSION moves it back).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Mapping, Optional

# The one place that maps a torch release series to the tch/torch-sys release to build with.
# Each tch release is generated for one libtorch (its C++ API and ABI change every release); tch
# and torch-sys share version numbers and tch pins its torch-sys exactly. torch 2.12's own
# binding, tch 0.25, was never published on the crate registry: 2.12 builds with tch 0.26 (made
# for 2.13), whose C++ wrappers torch-sys compiles against the environment's torch 2.12 headers,
# so an op or a signature 2.12 lacks would stop the build, never run wrong (built and the crate's
# unit tests run against torch 2.12.0; CONTRIBUTING.md, "Building against another torch").
TCH_FOR_TORCH = {"2.11": "0.24.0", "2.12": "0.26.0", "2.13": "0.26.0"}
# Series inside the range with no binding to build against, and why.
TORCH_WITHOUT_TCH: dict = {}
NEWEST_SERIES = max(TCH_FOR_TORCH, key=lambda s: tuple(map(int, s.split("."))))
HDF5_MODES = ("auto", "system", "static")
# Where hdf5-metno-sys looks for headers when pkg-config has no `hdf5` (its build.rs, Linux).
HDF5_DEFAULT_INCLUDE_DIRS = ("/usr/include/hdf5/serial", "/usr/include")
CMAKE_MIN = (3, 18)

_TORCH_PROBE = r"""
import json, os, sys
try:
    import torch
except Exception as e:
    print(json.dumps({"error": "%s: %s" % (type(e).__name__, e)}))
    sys.exit(0)
print(json.dumps({
    "version": torch.__version__,
    "dir": os.path.dirname(os.path.abspath(torch.__file__)),
    "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
    "cuda": torch.version.cuda,
}))
"""


class BuildError(Exception):
    pass


def _log(msg: str) -> None:
    print(f"diffmon build: {msg}", file=sys.stderr, flush=True)


def _fail(msg: str):
    # pip shows a failed backend's output; a traceback would bury the message.
    print(f"\nerror: diffmon cannot be built: {msg}\n", file=sys.stderr, flush=True)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------
# Checks


def probe_torch(python: str) -> dict:
    """torch's version, folder and ABI as `python` sees them outside pip's build overlay."""
    try:
        out = subprocess.run([python, "-E", "-c", _TORCH_PROBE], capture_output=True, text=True,
                             cwd=tempfile.gettempdir(), timeout=300)
    except OSError as e:
        return {"error": f"cannot run {python}: {e}"}
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"error": f"{python} failed: " + " / ".join(tail)}
    lines = out.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"{python} printed no answer: {out.stdout!r}"}


def find_torch() -> dict:
    explicit = os.environ.get("DIFFMON_PYTHON")
    candidates = [explicit] if explicit else [sys.executable]
    if not explicit:
        # A frontend that builds in a virtual environment of its own: the user's is still active.
        for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
            root = os.environ.get(var)
            exe = os.path.join(root, "bin", "python") if root else None
            if exe and os.path.isfile(exe) and os.path.realpath(exe) not in map(os.path.realpath, candidates):
                candidates.append(exe)
    errors = []
    for python in candidates:
        info = probe_torch(python)
        if "error" not in info:
            info["python"] = python
            return info
        errors.append(f"  {python}: {info['error']}")
    raise BuildError(
        "torch is not importable in the environment being installed into:\n" + "\n".join(errors)
        + f"\ndiffmon links against the environment's libtorch: install torch {supported_text()}"
        f" there first (for example pip install 'torch=={NEWEST_SERIES}.*'), then run"
        " `pip install ./` again with that environment's pip. If your installer builds in an"
        " environment of its own, set DIFFMON_PYTHON to the interpreter whose torch to use.")


def _series_key(series: str) -> tuple:
    return tuple(int(p) for p in series.split("."))


def supported_text() -> str:
    """'2.11.x, 2.12.x or 2.13.x' (from TCH_FOR_TORCH)."""
    names = [f"{s}.x" for s in sorted(TCH_FOR_TORCH, key=_series_key)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def torch_series(version: str) -> Optional[str]:
    """'2.11' for '2.11.0' or '2.11.1+cu130'; None for anything but an X.Y.Z release (a nightly
    or a pre-release is not the libtorch a tch release was generated for)."""
    m = re.fullmatch(r"(\d+)\.(\d+)\.\d+", version.split("+", 1)[0])
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


def _unsupported(version: str) -> str:
    series = torch_series(version)
    pairs = ", ".join(f"tch {TCH_FOR_TORCH[s]} for torch {s}"
                      for s in sorted(TCH_FOR_TORCH, key=_series_key))
    why = f" (torch {series}: {TORCH_WITHOUT_TCH[series]})" if series in TORCH_WITHOUT_TCH else ""
    return (f"diffmon builds against torch {supported_text()}{why}. It links the environment's"
            " libtorch through the tch crate, and libtorch's C++ API and ABI change with every"
            f" torch release, so each tch release is generated for exactly one ({pairs}) and"
            " cannot link against another.")


def tch_for_torch(version: str) -> str:
    """The tch/torch-sys release for this torch version, or BuildError naming the supported ones."""
    series = torch_series(version)
    if series in TCH_FOR_TORCH:
        return TCH_FOR_TORCH[series]
    raise BuildError(f"torch {version} is not supported: {_unsupported(version)}")


def check_torch(info: dict) -> str:
    """Checks the probed torch; returns the tch release to build with."""
    version = info["version"]
    if torch_series(version) not in TCH_FOR_TORCH:
        raise BuildError(
            f"the environment has torch {version} ({info['dir']}), which is not supported:"
            f" {_unsupported(version)} Install one of the supported releases in this environment"
            f" (or a new one), for example 'torch=={NEWEST_SERIES}.*', and try again.")
    tch = tch_for_torch(version)
    lib = os.path.join(info["dir"], "lib")
    include = os.path.join(info["dir"], "include", "torch")
    if not os.path.isdir(lib) or not os.path.isdir(include):
        raise BuildError(f"torch at {info['dir']} has no lib/ or include/torch/: a torch wheel"
                         " ships both; reinstall torch from a wheel")
    return tch


# ---------------------------------------------------------------------------------------------
# Cargo.lock: the tch release that matches the torch


def locked_versions(lock_text: str) -> dict:
    """{'tch': '0.26.0', 'torch-sys': '0.26.0'} as Cargo.lock pins them (registry entries)."""
    found = {}
    for block in lock_text.split("[[package]]"):
        name = re.search(r'^name = "([^"]+)"', block, re.M)
        version = re.search(r'^version = "([^"]+)"', block, re.M)
        if name and version and name.group(1) in ("tch", "torch-sys"):
            found[name.group(1)] = version.group(1)
    return found


def _cargo() -> str:
    return os.environ.get("CARGO") or shutil.which("cargo") or "cargo"


def select_tch(root: str, tch: str) -> Optional[str]:
    """Moves root/Cargo.lock to tch and torch-sys `tch`. Returns the lock's text before the change,
    or None when it already pinned that release (nothing was written)."""
    path = os.path.join(root, "Cargo.lock")
    with open(path, encoding="utf-8") as f:
        before = f.read()
    pinned = locked_versions(before)
    if pinned == {"tch": tch, "torch-sys": tch}:
        return None
    _log(f"Cargo.lock pins tch {pinned.get('tch')} and torch-sys {pinned.get('torch-sys')}:"
         f" moving both to {tch} (cargo update --precise)")
    try:
        for crate in ("tch", "torch-sys"):
            with open(path, encoding="utf-8") as f:
                if locked_versions(f.read()).get(crate) == tch:
                    continue  # torch-sys usually moves along with tch
            r = subprocess.run([_cargo(), "update", "-p", crate, "--precise", tch],
                               cwd=root, capture_output=True, text=True)
            if r.returncode != 0:
                raise BuildError(f"`cargo update -p {crate} --precise {tch}` failed in {root}:\n"
                                 + (r.stderr or r.stdout).strip())
        with open(path, encoding="utf-8") as f:
            after = locked_versions(f.read())
        if after != {"tch": tch, "torch-sys": tch}:
            raise BuildError(f"Cargo.lock pins {after} after `cargo update`, not {tch} for both")
    except BaseException:
        restore_lock(root, before)
        raise
    return before


def restore_lock(root: str, text: Optional[str]) -> None:
    if text is None:
        return
    with open(os.path.join(root, "Cargo.lock"), "w", encoding="utf-8") as f:
        f.write(text)


def check_toolchain() -> None:
    cargo = os.environ.get("CARGO") or shutil.which("cargo")
    if not cargo:
        raise BuildError(
            "cargo (Rust) was not found on PATH. Install a Rust toolchain for your user with"
            " rustup (no root needed: it goes to ~/.cargo and ~/.rustup), open a new shell (or"
            " `source ~/.cargo/env`) and run `pip install ./` again.")
    cxx = [os.environ.get("CXX")] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    cc = [os.environ.get("CC")] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    missing = [kind for kind, names in (("C++", cxx), ("C", cc))
               if not any(shutil.which(shlex.split(n)[0]) for n in names)]
    if missing:
        raise BuildError(
            f"no {' or '.join(missing)} compiler on PATH (looked for"
            f" {', '.join(cxx + cc)}): diffmon compiles a C++ shim over libtorch and links with"
            " the C compiler. Load one (for example `module load gcc` on a cluster), or install"
            " your distribution's g++, or set CC/CXX.")


# Where openssl-sys (under reqwest's native-tls, for webhooks) looks when pkg-config has nothing.
OPENSSL_PREFIXES = ("/usr/local/ssl", "/usr/lib/ssl", "/usr/local", "/usr/pkg", "/usr", "/opt/local")


def openssl_found() -> bool:
    if any(os.environ.get(v) for v in ("OPENSSL_DIR", "OPENSSL_INCLUDE_DIR")):
        return True
    if shutil.which("pkg-config"):
        if subprocess.run(["pkg-config", "--exists", "openssl"], capture_output=True).returncode == 0:
            return True
    return any(os.path.isfile(os.path.join(p, "include", "openssl", "opensslv.h")) for p in OPENSSL_PREFIXES)


OPENSSL_MODES = ("auto", "system", "vendored")


def openssl_mode() -> tuple[str, str]:
    """('system' | 'vendored', why). Building OpenSSL needs perl (with IPC::Cmd) and make."""
    mode = os.environ.get("DIFFMON_OPENSSL", "auto").strip().lower() or "auto"
    if mode not in OPENSSL_MODES:
        raise BuildError(f"DIFFMON_OPENSSL={mode!r}: use one of {', '.join(OPENSSL_MODES)}")
    if mode == "system":
        return "system", "DIFFMON_OPENSSL=system"
    if mode == "auto" and openssl_found():
        return "system", "found its headers"
    why = "DIFFMON_OPENSSL=vendored" if mode == "vendored" else (
        "no OpenSSL headers found (OPENSSL_DIR, pkg-config openssl, /usr/include/openssl)")
    perl_ok = shutil.which("perl") and subprocess.run(
        ["perl", "-MIPC::Cmd", "-MFindBin", "-MFile::Compare", "-e", "1"], capture_output=True).returncode == 0
    if not perl_ok or not shutil.which("make"):
        raise BuildError(
            f"{why}, and OpenSSL cannot be built from source here: that needs perl (with its core"
            " modules IPC::Cmd, FindBin, File::Compare) and make. Install OpenSSL's headers"
            " (Debian: libssl-dev, RHEL: openssl-devel, or load a module and set OPENSSL_DIR to"
            " its prefix), or make perl and make available.")
    return "vendored", why


def system_hdf5() -> Optional[str]:
    """Where the HDF5 build would find a system HDF5, or None."""
    if os.environ.get("HDF5_DIR"):
        return f"HDF5_DIR={os.environ['HDF5_DIR']}"
    if shutil.which("pkg-config"):
        r = subprocess.run(["pkg-config", "--exists", "hdf5"], capture_output=True)
        if r.returncode == 0:
            return "pkg-config hdf5"
    for inc in HDF5_DEFAULT_INCLUDE_DIRS:
        if os.path.isfile(os.path.join(inc, "hdf5.h")):
            return inc
    return None


def hdf5_mode() -> tuple[str, str]:
    """('system' | 'static', why)."""
    mode = os.environ.get("DIFFMON_HDF5", "auto").strip().lower() or "auto"
    if mode not in HDF5_MODES:
        raise BuildError(f"DIFFMON_HDF5={mode!r}: use one of {', '.join(HDF5_MODES)}")
    if mode == "static":
        return "static", "DIFFMON_HDF5=static"
    found = system_hdf5()
    if mode == "system":
        return "system", f"DIFFMON_HDF5=system ({found or 'not found here; the build will say'})"
    if found:
        return "system", f"found {found}"
    return "static", "no system HDF5 found (HDF5_DIR, pkg-config hdf5, /usr/include[/hdf5/serial])"


def _cmake_ok() -> bool:
    cmake = os.environ.get("CMAKE") or shutil.which("cmake")
    if not cmake:
        return False
    try:
        out = subprocess.run([cmake, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        return False
    m = re.search(r"(\d+)\.(\d+)", out)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= CMAKE_MIN


# ---------------------------------------------------------------------------------------------
# The build's environment


def _with_features(config_settings: Optional[Mapping[str, Any]], features: list):
    """Adds `--features a,b` to maturin's arguments, where maturin will read them."""
    args = ["--features", ",".join(features)]
    cs = dict(config_settings or {})
    for key in ("maturin.build-args", "build-args"):
        if key in cs:
            value = cs[key]
            cs[key] = (shlex.split(value) if isinstance(value, str) else list(value)) + args
            return cs
    os.environ["MATURIN_PEP517_ARGS"] = " ".join(
        filter(None, [os.environ.get("MATURIN_PEP517_ARGS", ""), shlex.join(args)]))
    return config_settings


def _prepare(config_settings):
    """Checks, then sets the environment of the cargo build. Returns maturin's config_settings
    and the probed torch (with the tch release to build with)."""
    try:
        check_toolchain()
        info = find_torch()
        info["tch"] = check_torch(info)
        hdf5, why = hdf5_mode()
        openssl, openssl_why = openssl_mode()
    except BuildError as e:
        _fail(str(e))
    if os.environ.get("LIBTORCH") and os.path.realpath(os.environ["LIBTORCH"]) != os.path.realpath(info["dir"]):
        _log(f"ignoring LIBTORCH={os.environ['LIBTORCH']}: linking the environment's torch")
    os.environ["LIBTORCH"] = info["dir"]
    os.environ["LIBTORCH_CXX11_ABI"] = "1" if info["cxx11_abi"] else "0"
    # The environment's torch never needs LIBTORCH_USE_PYTORCH, and maturin must not install Rust.
    os.environ.pop("LIBTORCH_USE_PYTORCH", None)
    os.environ["MATURIN_NO_INSTALL_RUST"] = "1"
    _log(f"torch {info['version']} (CUDA {info['cuda'] or 'none'}) from {info['python']}")
    _log(f"tch {info['tch']} (the libtorch binding for torch {torch_series(info['version'])}.x)")
    _log(f"LIBTORCH={info['dir']} LIBTORCH_CXX11_ABI={os.environ['LIBTORCH_CXX11_ABI']}")
    _log(f"HDF5: {'built from source (feature static-hdf5)' if hdf5 == 'static' else 'system'}: {why}")
    _log(f"OpenSSL: {'built from source (feature vendored-openssl)' if openssl == 'vendored' else 'system'}:"
         f" {openssl_why}")
    features = []
    if hdf5 == "static":
        if os.environ.pop("HDF5_DIR", None):
            _log("ignoring HDF5_DIR: with the static-hdf5 feature hdf5-metno-sys would link it")
        features.append("static-hdf5")
    if openssl == "vendored":
        features.append("vendored-openssl")
    if features:
        config_settings = _with_features(config_settings, features)
    return config_settings, info


# ---------------------------------------------------------------------------------------------
# PEP 517 hooks (maturin is imported here: the checks above run without it, in the tests too)


def _backend():
    import maturin

    return maturin


def get_requires_for_build_wheel(config_settings=None):
    _prepare(config_settings)  # fail before anything else is downloaded or built
    reqs = list(_backend().get_requires_for_build_wheel(config_settings))
    if hdf5_mode()[0] == "static" and not _cmake_ok():
        _log(f"no cmake >= {'.'.join(map(str, CMAKE_MIN))} on PATH: using cmake from PyPI")
        reqs.append("cmake>=3.18")
    return reqs


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _backend().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    config_settings, info = _prepare(config_settings)
    # pip builds a local folder in place: the user's own checkout. Cargo.lock is moved to the
    # matching tch for the build and put back afterwards (rather than building from a copy,
    # which would lose the checkout's target/ and make every reinstall a cold build).
    root = os.getcwd()
    try:
        before = select_tch(root, info["tch"])
    except BuildError as e:
        _fail(str(e))
    try:
        return _backend().build_wheel(wheel_directory, config_settings, metadata_directory)
    finally:
        if before is not None:
            restore_lock(root, before)
            _log("Cargo.lock put back as it was")


def get_requires_for_build_sdist(config_settings=None):
    return _backend().get_requires_for_build_sdist(config_settings)


def build_sdist(sdist_directory, config_settings=None):
    return _backend().build_sdist(sdist_directory, config_settings)


# ---------------------------------------------------------------------------------------------
# Command line: the same selection for `make build` (see the module docstring)


def main(argv=None) -> int:
    import argparse

    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(
        prog="diffmon_build.py",
        description="Moves Cargo.lock to the tch release that matches an interpreter's torch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sel = sub.add_parser("select-tch", help="probe torch, check it, pin the matching tch in Cargo.lock")
    sel.add_argument("--python", default=sys.executable, help="the interpreter whose torch to use")
    sel.add_argument("--root", default=os.path.dirname(os.path.dirname(here)),
                     help="the checkout holding Cargo.lock (default: this file's)")
    args = parser.parse_args(argv)
    # The probe runs in a neutral folder: a relative path (.venv/bin/python) is made absolute,
    # without resolving links (a virtual environment's python is one).
    python = os.path.abspath(args.python) if os.sep in args.python else args.python
    try:
        info = probe_torch(python)
        if "error" in info:
            raise BuildError(f"torch is not importable by {python}: {info['error']}")
        tch = check_torch(info)
        before = select_tch(args.root, tch)
    except BuildError as e:
        _fail(str(e))
    state = "moved Cargo.lock to it" if before is not None else "Cargo.lock already pins it"
    _log(f"torch {info['version']}: tch {tch}; {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
