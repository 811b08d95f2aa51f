"""Host time per call of a PyTorch call sequence (op_overhead.py, autograd_floor.py)."""
import time

import torch


def per_call_us(fn, calls, repeats=5, cuda=True):
    """Best of `repeats` bursts of `calls` calls, in µs per call. On CUDA each burst is queued
    behind a GPU sleep of tens of ms and short enough that the launch queue never fills: the host
    never waits for the GPU. cuda=False times the bursts alone (a CPU run)."""
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # cycles: tens of ms at H200 clocks
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    if cuda:
        torch.cuda.synchronize()
    return best
