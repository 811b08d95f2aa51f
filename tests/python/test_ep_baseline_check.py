"""benchmarks/ep_torch_baseline.py's check across ranks: the worst error over the ranks is NaN when
any rank's is, wherever that rank stands (max() keeps a finite number compared before a NaN), so
the check's `e <= tolerance` fails. Needs torch (the script imports it), not a GPU."""
import math
import os
import sys

import pytest

pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import ep_torch_baseline  # noqa: E402


def test_nan_on_any_rank_is_the_worst():
    assert ep_torch_baseline.worst_error([1e-3, 4e-3, 2e-3]) == 4e-3
    assert math.isnan(ep_torch_baseline.worst_error([1e-3, math.nan]))
    assert math.isnan(ep_torch_baseline.worst_error([math.nan, 1e-3]))
    assert ep_torch_baseline.worst_error([1e-3, math.inf]) == math.inf
