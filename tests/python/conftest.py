"""pytest set-up for tests/python: python/ on sys.path (unless FUSEMOE_TEST_INSTALLED=1, which
tests the installed package instead, e.g. a wheel from `pip install .`), and the GPU gate.

GPU tests call require_gpu(): it skips (never passes) where there is no torch, no CUDA device,
no Hopper (sm_90) GPU or no built libfusemoe_c.so. With FUSEMOE_REQUIRE_GPU=1 (the GPU round
sets it) each of those is a failure instead, so a round on the H200 cannot pass by skipping.
Likewise FUSEMOE_REQUIRE_NATIVE=1 (scripts/run_tests.sh sets it where it built the native binding)
turns test_native_binding.py's skips for want of the binding into failures; FUSEMOE_NATIVE=0 runs
the suite on the ctypes path.
"""
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if os.environ.get("FUSEMOE_TEST_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "backend(name): torch.distributed backend of the test")


def require_gpu():
    def missing(reason):
        if os.environ.get("FUSEMOE_REQUIRE_GPU") == "1":
            pytest.fail(f"FUSEMOE_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)

    try:
        import torch
    except ImportError:
        missing("skipped: PyTorch is not installed")
    if not torch.cuda.is_available():
        missing("skipped: no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        missing(f"skipped: fusemoe needs an sm_90 GPU, found {torch.cuda.get_device_name()}")
    import fusemoe
    if not fusemoe.is_available():
        missing(f"skipped: libfusemoe_c.so not built (looked at {fusemoe.library_path()})")
