"""torch_baseline.py --fp8's weight copies (benchmarks/torch_baseline.py: cached_weight_fp8): made
once per weight version, as fusemoe's FP8 path makes its own, and made again after the weight
changes in place (an optimizer step), so the PyTorch FP8 timings never run on stale weights.
CPU: E4M3 casts run there; torch._scaled_grouped_mm itself needs the GPU round."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import torch_baseline  # noqa: E402


def same_codes(a, b):
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_weight_copies_follow_the_weight_version():
    torch_baseline._FP8_WEIGHT_CACHE.clear()
    w_ENK = torch.randn(3, 32, 16).bfloat16().requires_grad_()
    first = torch_baseline.cached_weight_fp8(w_ENK, transposed=False)
    assert same_codes(first, torch_baseline.rowwise_fp8(w_ENK.detach()))
    assert torch_baseline.cached_weight_fp8(w_ENK, transposed=False) is first  # same version: reused
    transposed = torch_baseline.cached_weight_fp8(w_ENK, transposed=True)
    assert transposed[0].shape == (3, 16, 32)
    assert same_codes(transposed, torch_baseline.rowwise_fp8(w_ENK.detach().transpose(-2, -1).contiguous()))
    with torch.no_grad():
        w_ENK.mul_(-3.0)  # an optimizer step: same storage, new version
    again = torch_baseline.cached_weight_fp8(w_ENK, transposed=False)
    assert again is not first
    assert same_codes(again, torch_baseline.rowwise_fp8(w_ENK.detach()))
    assert not same_codes(again, first)
