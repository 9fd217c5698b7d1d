import sys
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]
if str(PYTHON_DIR) not in sys.path:
    sys.path.insert(0, str(PYTHON_DIR))

import torch  # noqa: E402

# Tiny tensors: one thread is as fast as two and does not collapse when other jobs share the cores.
torch.set_num_threads(1)


def pytest_configure(config):
    # The studies' end-to-end runs on tiny plans (minutes each): `make test-studies`, not `make test`.
    config.addinivalue_line("markers", "study: a study script's end-to-end run (make test-studies)")
    config.addinivalue_line("markers", "long: over a CPU-minute of training and watching (make test-long)")
    # TorchScript is diffmon's model format; torch's deprecation notices about it are noise here.
    config.addinivalue_line("filterwarnings", r"ignore:.*torch\.jit.*:DeprecationWarning")
