# Two commands do everything on a fresh Debian machine (as root):
#   make demo   set up if needed, then a toy training run evaluated by diffmon
#   make test   set up if needed, then every test
#   make fuzz   set up if needed, then each fuzz target for FUZZ_SECONDS (default 60)
#   make chaos  set up if needed, then the chaos suite, one case at a time, and its table
#               (scripts/chaos; about 20 minutes on 2 cores; its cheap cases are in make test)
#   make test-long   the long tier: the tests of over 40 CPU-seconds each (about 1450 CPU-seconds,
#               so some 12 minutes on 2 cores, not yet timed as a whole; CI runs it after make test)
#   make test-studies   the studies' end-to-end runs on tiny plans (not part of make test)
#   make test-gpu   the GPU test tier (tests/gpu); skipped, saying why, without a CUDA device
#   make bench-gpu  the GPU benchmark (bench/bench_gpu.py; about 5 minutes on an H100)
#   make test-install   the no-root `pip install ./` end to end, as an unprivileged user, in a
#               fresh virtual environment, for each supported torch (a cold build each: 5 to
#               15 min; not part of `make test`)
# `make setup` is idempotent and cheap once done. `make setup TORCH_VERSION=2.11.0` sets the
# project up against another supported torch (2.11.x, 2.12.x or 2.13.x; the default is 2.13.0).

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
BIN := target/release/diffmon
TORCH_VERSION := 2.13.0
# The no-root install test's torch releases, each with its HDF5/OpenSSL mode (scripts/test-install):
# the newest with both built from source, 2.11 linking the system's (a shorter build).
TEST_INSTALL_TORCH ?= 2.13.0:hidden 2.11.0:system
APT_PACKAGES := build-essential pkg-config libhdf5-dev libssl-dev python3-venv prometheus prometheus-alertmanager time chromium fonts-dejavu-core slurm-wlm munge
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= checkpoint pickle safetensors config tensorboard
export CARGO_TERM_COLOR := never

.PHONY: setup apt venv build bin test test-long chaos test-studies test-gpu bench-gpu gpu-bundle test-install demo bench clean-demo lint fuzz FORCE

setup: apt venv build bin

apt:
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
	  echo "setup: installing Debian packages: $(APT_PACKAGES)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(APT_PACKAGES); \
	fi

venv: $(VENV)/.installed

# The torch release the venv holds: the stamp file changes only when TORCH_VERSION does, so a
# different TORCH_VERSION reinstalls torch and the requirements.
TORCH_STAMP := $(VENV)/.torch-version
$(TORCH_STAMP): FORCE
	@mkdir -p $(VENV)
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH_VERSION)" ]; then echo "$(TORCH_VERSION)" > $@; fi

# While pip installs torch, cargo compiles the crates that need no libtorch, in the build's own
# profile and features (`--keep-going`: torch-sys's build script fails without libtorch, and what
# depends on it waits for `build`; the crates before it compile, 267 of them). From a fresh clone
# at cfaa748 set-up took 12 minutes on 2 cores: pip 7 with this build beside it, then 5.4 for
# the rest of the build. Its output: target/deps-build.log. `--no-compile`: Python compiles the modules it imports when it first
# does, instead of pip compiling the thousands torch ships.
$(VENV)/.installed: python/requirements.txt python/requirements-nodeps.txt $(TORCH_STAMP)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@deps=; if command -v cargo >/dev/null && [ ! -e $(VENV)/libtorch ]; then \
	  mkdir -p target; cargo build --release --locked --keep-going $(DEPS_TARGETS) > target/deps-build.log 2>&1 & deps=$$!; \
	fi; \
	$(PY) -m pip install -q --no-compile torch==$(TORCH_VERSION) -r python/requirements.txt; \
	if [ -n "$$deps" ]; then wait $$deps || true; fi
	$(PY) -m pip install -q --no-deps -r python/requirements-nodeps.txt
	@# tch's build reads libtorch from this link (see .cargo/config.toml).
	ln -sfn "$$($(PY) -c 'import os, torch; print(os.path.dirname(torch.__file__))')" $(VENV)/libtorch
	touch $@

# Cargo.lock pins the tch release of the venv's torch first (tools/build-backend/diffmon_build.py:
# tch 0.26 for torch 2.13, 0.24 for 2.11; an unsupported torch stops here, naming the supported).
# Under `make test` one cargo run builds the binary and the tests: the crate in test mode then
# compiles beside the binary's crate instead of after it.
BUILD := $(if $(filter test,$(MAKECMDGOALS)),test --no-run,build)
# The targets of the venv's early build: the build's own (`cargo test` has no `--keep-going`).
DEPS_TARGETS := $(if $(filter test,$(MAKECMDGOALS)),--tests)
build: venv
	$(PY) tools/build-backend/diffmon_build.py select-tch --python $(PY)
	cargo $(BUILD) --release --locked

# `. .venv/bin/activate` after `make setup` puts `diffmon` (a link to the release build),
# `diffmon-export` (the helpers of python/, installed editable) and the venv's python on PATH:
# the README's commands then run as written.
bin: build $(VENV)/.helpers
	ln -sfn "$(CURDIR)/$(BIN)" $(VENV)/bin/diffmon

$(VENV)/.helpers: python/pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q --no-deps -e ./python
	touch $@

test: setup
	scripts/run-tests

# The tests scripts/run-tests names LONG, and pytest's `long` marker.
test-long: setup
	scripts/run-tests --long

chaos: setup
	scripts/chaos

# The studies' end-to-end runs on tiny plans (pytest's `study` marker): the MNIST study and the
# quality benchmark, about 7 minutes on 2 cores; not part of `make test`.
test-studies: setup
	PYTHONPATH=python $(PY) -m pytest python/tests -q -p no:cacheprovider -m study

# The GPU tier (tests/gpu): the built binary on a CUDA device, CPU and GPU results compared;
# every test skipped, saying why, where no CUDA device is visible. Not part of `make test`.
# On a GPU machine without Rust or internet: `make gpu-bundle` on a build machine, then
# scripts/test-gpu there (CONTRIBUTING.md, "Testing on a GPU").
test-gpu: setup
	scripts/test-gpu

# dist/gpu/: the binary built against GPU_TORCH (static HDF5 and OpenSSL) and the test tier's
# wheels, for a GPU machine with that torch (scripts/gpu-bundle).
GPU_TORCH ?= 2.11.0
gpu-bundle:
	GPU_TORCH=$(GPU_TORCH) scripts/gpu-bundle

# README, "Install without root": torch's wheels into a fresh virtual environment, then
# `pip install ./` and `diffmon eval` as the user nobody, once per TEST_INSTALL_TORCH entry
# (torch version:libs): `hidden` hides the system's HDF5 and OpenSSL headers so the install builds
# both from source, `system` links the system's. Needs root, the Debian packages (a C/C++
# compiler, python3-venv) and root's Rust toolchain; it never uses .venv or target/. Prints a
# `summary: N passed, N failed` line per torch release; fails when any run does.
test-install: apt
	@status=0; for entry in $(TEST_INSTALL_TORCH); do \
	  echo "== make test-install: torch $${entry%%:*}, INSTALL_TEST_LIBS=$${entry##*:}"; \
	  TORCH_VERSION=$${entry%%:*} INSTALL_TEST_LIBS=$${entry##*:} scripts/test-install || status=1; \
	done; exit $$status

demo: setup
	scripts/demo

# cargo-fuzz targets in fuzz/ (CONTRIBUTING.md, "Fuzzing"); nightly with AddressSanitizer when rustup
# has a nightly toolchain, else stable without a sanitizer. Exits non-zero on a finding.
fuzz: setup
	@cargo fuzz --version >/dev/null 2>&1 || cargo install cargo-fuzz --locked
	FUZZ_SECONDS=$(FUZZ_SECONDS) PYTHON=$(PY) scripts/fuzz $(FUZZ_TARGETS)

bench: setup
	$(PY) bench/bench.py

# bench/bench_gpu.py on a CUDA device (BENCHMARKS.md, "GPU"): the network's own rates, diffmon's
# ICR and PFD against them and a researcher's script, and a training job sharing the GPU. On a
# GPU machine without the set-up: `PYTHON=python3 scripts/test-gpu --bundle dist/gpu --bench`.
bench-gpu: setup
	$(PY) bench/bench_gpu.py --out bench-gpu

lint: setup
	cargo fmt --check
	cargo clippy --release --all-targets --locked -- -D warnings
