"""fusemoe.ExpertParallelMoEExperts over R = 2 processes (torch.multiprocessing spawn, a gloo
group), against the single-GPU op on the concatenated batch.

GPU (an sm_90 GPU and the library, else skipped; a failure under FUSEMOE_REQUIRE_GPU=1): rank r
on GPU r where the machine has a GPU per rank (the symmetric memory then spans NVLink), else both
processes on GPU 0 with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (the GPU time-slices between
them; correctness only).
(a) y, dx and d_topk_weights of each rank's tokens and dw13/dw2 of its experts are bitwise those
    of fusemoe.moe_experts (impl "fused") on every rank's tokens concatenated, rank 0's first:
    even, uneven and empty ranks, saved and recomputed z, two calls in a row, the Qwen3-30B-A3B
    shape, torch.compile(fullgraph=True) and activation checkpointing; a bad expert id on one
    rank is raised by fusemoe.check_expert_ids() on that rank only.
(a') precision="fp8": the same outputs bitwise those of fusemoe.moe_experts(impl="fused",
    precision="fp8") with the same recompute_z on the concatenated batch (the C++ layer's claim,
    its ExpertParallelFp8 cases); the FP8 weights quantized once for two calls; the library's
    ep_quantize_weights_fp8 makes the very bytes of the module's cached buffer.
(b) examples/train_qwen3_moe_ep.py under torchrun (2 processes) trains within bf16 noise of the
    single-GPU run of examples/train_qwen3_moe.py: per-step loss and gradient norm within twice
    the noise floor that run measures (Hugging Face experts in two micro-batch orders) plus a
    small bound.
CPU (no GPU needed): the argument checks, the refusal of ranks whose GPUs cannot map each
other's memory (torch.cuda stand-ins), and (a) and (b) over the CPU stand-ins of
moe_reference.py (register_cpu_ep_kernels, cpu_connect), which test the module, the ops'
autograd and fake kernels and the example's data-parallel loop without the CUDA layer.
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, L = E / R local
experts, K top-k.
"""
import functools
import gc
import json
import os
import socket
import subprocess
import sys
import time
import types
import weakref

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import fusemoe  # noqa: E402
from fusemoe import expert_parallel  # noqa: E402
from conftest import REPO, require_gpu  # noqa: E402
from moe_reference import (OUTPUTS, cpu_connect, make_problem,  # noqa: E402
                           register_cpu_ep_kernels, register_cpu_kernels, run_layer)
from fusemoe import _capi  # noqa: E402
from fusemoe._checks import fp8_weights_bytes  # noqa: E402

WORLD_SIZE = 2
RANKS_TIMEOUT_S = 300  # every rank's whole job; a hung collective fails the test, not the round
# The layer's cross-rank wait bound (default 30 s) must cover the ranks' skew on the host: here
# two torch.compile runs, one per process, that can finish seconds apart.
WAIT_TIMEOUT_S = "120"
EXAMPLES = os.path.join(REPO, "examples")


# ---- running R ranks ----

def _rank_main(rank, fn, world_size, store, args):
    """One spawned rank: a gloo group through a file store, fn, then the group's teardown."""
    if store is not None:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, tmp_path, *args, init_group=True, timeout=RANKS_TIMEOUT_S):
    """fn(rank, WORLD_SIZE, *args) in WORLD_SIZE spawned processes (fn at module level). A rank
    that raises fails the test with its traceback (the others are killed); so does a job that
    outlives timeout seconds."""
    import torch.multiprocessing as mp
    store = str(tmp_path / "store") if init_group else None
    context = mp.start_processes(_rank_main, args=(fn, WORLD_SIZE, store, args),
                                 nprocs=WORLD_SIZE, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"the {WORLD_SIZE} ranks did not finish within {timeout} s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks_on_a_free_port(fn, tmp_path, args, attempts=3):
    """run_ranks(fn, tmp_path, port, args) without a group, on a port the OS has just given out.
    Another process can take the port between its release here and rank 0's bind; on "address
    already in use" the ranks start again on another one."""
    import torch.multiprocessing as mp
    for attempt in range(attempts):
        try:
            return run_ranks(fn, tmp_path, free_port(), args, init_group=False)
        except mp.ProcessRaisedException as error:
            if "address already in use" not in str(error).lower() or attempt == attempts - 1:
                raise


# ---- (a) the op against the single-GPU op ----

def assert_bitwise(rank, name, got, want):
    """Equal bits (-0 and +0 differ), and a finite reference (a NaN on both sides fails)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"rank {rank} {name}: {got.dtype} {tuple(got.shape)}, "
        f"expected {want.dtype} {tuple(want.shape)}")
    assert torch.isfinite(want).all(), f"rank {rank} {name}: the reference is not finite"
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[want.dtype]
    same = got.contiguous().view(bits) == want.contiguous().view(bits)
    if not bool(same.all()):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"rank {rank} {name}: {int((~same).sum())} of {same.numel()} "
                             f"elements differ, max |diff| {diff.max().item():.3e}")


# tokens per rank, (H, I, E, K), seed, recompute_z
OP_CASES = {
    "even": ((96, 96), (256, 128, 8, 2), 11, False),
    "uneven_recompute_z": ((150, 41), (256, 128, 8, 2), 12, True),
    "empty_rank": ((64, 0), (256, 128, 8, 2), 13, False),
    "qwen3_30b_a3b": ((256, 200), (2048, 768, 128, 8), 14, False),
}


def ep_outputs(rank, p, tokens, dims, recompute_z, device, call="eager", calls=1,
               precision="bf16"):
    """OUTPUTS of this rank's ExpertParallelMoEExperts share (from_experts of the whole layer
    p, at precision) on its tokens of p; call: "eager", "compiled" (torch.compile fullgraph) or
    "checkpointed" (non-reentrant activation checkpointing). calls > 1 repeats the forward and
    backward and returns the last outputs."""
    hidden, intermediate, num_experts, top_k = dims
    first, count = sum(tokens[:rank]), tokens[rank]
    whole = types.SimpleNamespace(gate_up_proj=p["w13_EFH"], down_proj=p["w2_EHI"])
    module = fusemoe.ExpertParallelMoEExperts.from_experts(
        whole, max_tokens_per_rank=max(tokens), top_k=top_k, recompute_z=recompute_z,
        precision=precision)
    forward = module
    if call == "compiled":
        forward = torch.compile(module, fullgraph=True)
    elif call == "checkpointed":
        def forward(*inputs):
            return torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False)
    rows = slice(first, first + count)
    for _ in range(calls):
        module.zero_grad(set_to_none=True)
        x_TH = p["x_TH"][rows].clone().requires_grad_()
        topk_weights_TK = p["topk_weights_TK"][rows].clone().requires_grad_()
        y_TH = forward(x_TH, p["topk_idx_TK"][rows], topk_weights_TK)
        y_TH.backward(p["dy_TH"][rows])
    return dict(zip(OUTPUTS, (y_TH.detach(), x_TH.grad, topk_weights_TK.grad,
                              module.gate_up_proj.grad, module.down_proj.grad))), module


def check_case(rank, case, device, call="eager", calls=1, precision="bf16"):
    """precision "fp8": against the single-GPU FP8 op with the same recompute_z (the C++ cases
    compare like with like too); returns the module."""
    tokens, dims, seed, recompute_z = OP_CASES[case]
    p = make_problem(sum(tokens), *dims, device, seed=seed)
    single_op = fusemoe.moe_experts if precision == "bf16" else functools.partial(
        fusemoe.moe_experts, impl="fused", precision=precision, recompute_z=recompute_z)
    single = run_layer(single_op, p, torch.bfloat16)
    got, module = ep_outputs(rank, p, tokens, dims, recompute_z, device, call, calls, precision)
    first, count = sum(tokens[:rank]), tokens[rank]
    experts = slice(module.first_expert, module.first_expert + module.num_local_experts)
    rows = slice(first, first + count)
    for name in OUTPUTS:
        want = single[name][experts] if name in ("dw13", "dw2") else single[name][rows]
        assert_bitwise(rank, f"{case} ({precision}, {call}, {calls} call(s)) {name}", got[name],
                       want)
    return module


def use_device(device, rank):
    """A rank's set-up: GPU rank where there is a GPU per rank, else GPU 0 (every rank shares it),
    or the CPU stand-ins for the kernels and the symmetric memory."""
    if device == "cuda":
        torch.cuda.set_device(rank if torch.cuda.device_count() >= WORLD_SIZE else 0)
    else:
        expert_parallel._connect = cpu_connect
        register_cpu_kernels()
        register_cpu_ep_kernels()


def op_worker(rank, world_size, device):
    use_device(device, rank)
    for case in OP_CASES:
        if device == "cpu" and case == "qwen3_30b_a3b":
            continue  # the CPU stand-ins' fp32 loops: slow, and nothing more to see
        check_case(rank, case, device)
    check_case(rank, "even", device, calls=2)  # the symmetric workspace serves call after call
    check_case(rank, "uneven_recompute_z", device, call="compiled")
    check_case(rank, "even", device, call="checkpointed")
    check_grad_in_place(rank, device)
    check_frozen_experts(rank, device)
    if device == "cuda":
        check_bad_id_is_reported_on_its_rank(rank)


def fp8_op_worker(rank, world_size, device):
    """precision="fp8" against the single-GPU FP8 op: the OP_CASES (Qwen3-30B-A3B's shape on the
    GPU only), two calls through one module (its FP8 weights quantized once), and, on the GPU,
    the library's ep_quantize_weights_fp8 (C ABI) against the module's cached buffer, bytewise."""
    use_device(device, rank)
    for case in OP_CASES:
        if device == "cpu" and case == "qwen3_30b_a3b":
            continue  # as op_worker
        check_case(rank, case, device, precision="fp8")
    module = check_case(rank, "uneven_recompute_z", device, calls=2, precision="fp8")
    assert module._fp8_cache.quantizations == 1, (
        f"rank {rank}: {module._fp8_cache.quantizations} quantizations for one weight version")
    config = expert_parallel._context(module.context).config
    assert config.precision == "fp8"
    local = (module.num_local_experts, module.hidden_dim, module.intermediate_dim)
    assert config.fp8_weights_bytes == _capi.ep_fp8_weights_bytes(config) == \
        fp8_weights_bytes(*local)
    cached = module._fp8_cache._buffer
    assert cached.numel() == config.fp8_weights_bytes
    if device == "cuda":
        w13, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
        buffer = torch.full_like(cached, 0xFF)  # poisoned: every byte must be written
        _capi.ep_quantize_weights_fp8(config, w13.data_ptr(), w2.data_ptr(), buffer.data_ptr(),
                                      buffer.numel(), torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(buffer, cached), (
            f"rank {rank}: ep_quantize_weights_fp8 differs from quantize_weights_fp8 in "
            f"{int((buffer != cached).sum())} of {buffer.numel()} bytes")


def grad_in_place_steps(rank, p, tokens, dims, grad_in_place):
    """Two micro-batches (the second with dy negated and halved) through one module without
    zero_grad between them: per step (dx, d_topk_weights, gate_up_proj.grad, down_proj.grad)."""
    hidden, intermediate, num_experts, top_k = dims
    first, count = sum(tokens[:rank]), tokens[rank]
    whole = types.SimpleNamespace(gate_up_proj=p["w13_EFH"], down_proj=p["w2_EHI"])
    module = fusemoe.ExpertParallelMoEExperts.from_experts(
        whole, max_tokens_per_rank=max(tokens), top_k=top_k, grad_in_place=grad_in_place)
    rows = slice(first, first + count)
    steps = []
    for dy_TH in (p["dy_TH"][rows], (p["dy_TH"][rows] * -0.5).contiguous()):
        x_TH = p["x_TH"][rows].clone().requires_grad_()
        topk_weights_TK = p["topk_weights_TK"][rows].clone().requires_grad_()
        module(x_TH, p["topk_idx_TK"][rows], topk_weights_TK).backward(dy_TH)
        steps.append((x_TH.grad, topk_weights_TK.grad, module.gate_up_proj.grad.clone(),
                      module.down_proj.grad.clone()))
    return steps


def check_frozen_experts(rank, device):
    """Expert weights that do not require grad: the backward asks for no weight gradient (the
    library then computes none), .grad stays None, and dx and d_topk_weights are the trainable
    module's bitwise."""
    import moe_reference
    tokens, dims, seed, _ = OP_CASES["uneven_recompute_z"]
    p = make_problem(sum(tokens), *dims, device, seed=seed)
    hidden, intermediate, num_experts, top_k = dims
    first, count = sum(tokens[:rank]), tokens[rank]
    rows = slice(first, first + count)
    grads = []
    for frozen in (False, True):
        whole = types.SimpleNamespace(gate_up_proj=p["w13_EFH"], down_proj=p["w2_EHI"])
        module = fusemoe.ExpertParallelMoEExperts.from_experts(
            whole, max_tokens_per_rank=max(tokens), top_k=top_k)
        module.requires_grad_(not frozen)
        x_TH = p["x_TH"][rows].clone().requires_grad_()
        topk_weights_TK = p["topk_weights_TK"][rows].clone().requires_grad_()
        requests = len(moe_reference.weight_grad_requests)
        module(x_TH, p["topk_idx_TK"][rows], topk_weights_TK).backward(p["dy_TH"][rows])
        if device == "cpu":  # the stand-ins record what each backward asked for
            asked = moe_reference.weight_grad_requests[requests:]
            assert asked == [(not frozen, not frozen)], f"rank {rank}: asked {asked}"
        grads.append((x_TH.grad, topk_weights_TK.grad, module.gate_up_proj.grad,
                      module.down_proj.grad))
    assert grads[1][2] is None and grads[1][3] is None, f"rank {rank}: frozen weights got .grad"
    for name, a, b in zip(("dx", "d_topk_weights"), grads[1], grads[0]):
        assert_bitwise(rank, f"frozen experts {name}", a, b)


def check_grad_in_place(rank, device):
    """grad_in_place=True: the first micro-batch's backward writes .grad bitwise what autograd
    gives; the second adds in the kernel (the TMA reduce-add of the bf16-rounded gradient, as
    autograd's bf16 add); dx and d_topk_weights are autograd's bitwise."""
    tokens, dims, seed, _ = OP_CASES["uneven_recompute_z"]
    p = make_problem(sum(tokens), *dims, device, seed=seed)
    calls = []
    into = expert_parallel.ep_moe_experts_backward_into

    def counted(*args):  # the backward took the in-place op (and the plain one did not)
        calls.append(args[8])  # accumulate
        return into(*args)

    expert_parallel.ep_moe_experts_backward_into = counted
    try:
        plain = grad_in_place_steps(rank, p, tokens, dims, grad_in_place=False)
        assert calls == []
        in_place = grad_in_place_steps(rank, p, tokens, dims, grad_in_place=True)
    finally:
        expert_parallel.ep_moe_experts_backward_into = into
    assert calls == [False, True], f"rank {rank}: backward_into calls (accumulate) {calls}"
    names = ("dx", "d_topk_weights", "dw13", "dw2")
    for step, (got, want) in enumerate(zip(in_place, plain)):
        for name, a, b in zip(names, got, want):
            if step == 0 or name in ("dx", "d_topk_weights"):
                assert_bitwise(rank, f"grad_in_place step {step + 1} {name}", a, b)
            else:  # both approximate the same sum of two micro-batches' gradients
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                assert err < 4e-3, f"rank {rank} grad_in_place step 2 {name}: rel err {err:.2e}"


def check_bad_id_is_reported_on_its_rank(rank):
    """Rank 0 routes token 5's slot 1 to expert E: the calls complete on both ranks (the ops
    never raise a pending report, so no peer waits for a call that is not made), and
    fusemoe.check_expert_ids() raises it on rank 0 only."""
    tokens, dims, seed, _ = OP_CASES["even"]
    p = make_problem(sum(tokens), *dims, "cuda", seed=seed)
    p["topk_idx_TK"][5, 1] = dims[2]
    ep_outputs(rank, p, tokens, dims, False, "cuda")
    if rank == 0:
        with pytest.raises(fusemoe.FusemoeError, match=rf"token 5, slot 1, value {dims[2]}"):
            fusemoe.check_expert_ids()
    else:
        fusemoe.check_expert_ids()


def test_op_matches_single_gpu_op_gpu(tmp_path, monkeypatch):
    require_gpu()
    monkeypatch.setenv(expert_parallel.ALLOW_OVERLAPPING_DEVICES, "1")
    monkeypatch.setenv("FUSEMOE_WAIT_TIMEOUT_S", WAIT_TIMEOUT_S)
    run_ranks(op_worker, tmp_path, "cuda")


def test_op_matches_single_op_cpu_stand_ins(tmp_path):
    run_ranks(op_worker, tmp_path, "cpu")


def test_fp8_op_matches_single_gpu_fp8_op_gpu(tmp_path, monkeypatch):
    require_gpu()
    monkeypatch.setenv(expert_parallel.ALLOW_OVERLAPPING_DEVICES, "1")
    monkeypatch.setenv("FUSEMOE_WAIT_TIMEOUT_S", WAIT_TIMEOUT_S)
    run_ranks(fp8_op_worker, tmp_path, "cuda")


def test_fp8_op_matches_single_fp8_op_cpu_stand_ins(tmp_path):
    """The module, its FP8 weight cache and the ops' FP8 arguments over the CPU stand-ins (which
    read each rank's weights back from its FP8 buffer, so a stale or missing buffer fails)."""
    run_ranks(fp8_op_worker, tmp_path, "cpu")


# ---- (b) the training example against the single-GPU run ----

# A small Qwen3-MoE, a learning rate that moves the loss within a few steps.
EXAMPLE_ARGS = ["--steps", "6", "--layers", "2", "--hidden", "256", "--moe-intermediate", "128",
                "--experts", "16", "--top-k", "4", "--heads", "4", "--kv-heads", "2",
                "--head-dim", "64", "--seq-len", "128", "--batch-size", "4",
                "--micro-batches", "2", "--lr", "1e-3", "--lr-warmup", "2",
                "--timing-warmup", "0", "--print-every", "1"]
# Step 1 (before any update) differs only by the dense layers' batch shapes: a loss that far off
# is another model. Gradient norms: the single run reports its norm in bf16 (8 bits).
FIRST_STEP_REL_TOL = 1e-3
LOSS_ATOL = 1e-3
GRAD_NORM_RTOL = 2e-2


def noise_floor(runs):
    """(max |loss diff|, max relative grad-norm diff) between the single run's Hugging Face runs
    in two micro-batch orders, or (0, 0) without them (the CPU)."""
    if "hf" not in runs or "hf_reordered" not in runs:
        return 0.0, 0.0
    a, b = runs["hf"], runs["hf_reordered"]
    return (max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
            max(abs(x - y) / y for x, y in zip(a["grad_norms"], b["grad_norms"])))


def check_example_against_single(ep, runs):
    """ep: train_qwen3_moe_ep.json; runs: train_qwen3_moe.json's runs. Every step's loss within
    2 x the loss noise floor + LOSS_ATOL of the single-GPU fusemoe run (step 1 within
    FIRST_STEP_REL_TOL), its gradient norm within 2 x the norm noise floor + GRAD_NORM_RTOL."""
    reference = runs["fusemoe"]
    assert ep["finite"] and reference["finite"]
    steps = len(reference["losses"])
    assert len(ep["losses"]) == steps
    loss_noise, norm_noise = noise_floor(runs)
    loss_tol, norm_rtol = 2 * loss_noise + LOSS_ATOL, 2 * norm_noise + GRAD_NORM_RTOL
    report = [f"step {s + 1}: loss ep {a:.5f} single {b:.5f} (|diff| {abs(a - b):.2e}, tol "
              f"{loss_tol:.2e}); grad norm ep {g:.4f} single {h:.4f} (rel diff "
              f"{abs(g - h) / h:.2e}, tol {norm_rtol:.2e})"
              for s, (a, b, g, h) in enumerate(zip(ep["losses"], reference["losses"],
                                                   ep["grad_norms"], reference["grad_norms"]))]
    print(f"noise floor: loss {loss_noise:.2e}, grad norm {norm_noise:.2e} (relative)")
    print("\n".join(report))
    first, first_ref = ep["losses"][0], reference["losses"][0]
    assert abs(first - first_ref) <= FIRST_STEP_REL_TOL * abs(first_ref), report[0]
    for s in range(steps):
        assert abs(ep["losses"][s] - reference["losses"][s]) <= loss_tol, report[s]
        g, h = ep["grad_norms"][s], reference["grad_norms"][s]
        assert abs(g - h) <= norm_rtol * h, report[s]
    # The training moved: a loop that never stepped would match too easily.
    assert reference["losses"][-1] < reference["losses"][0] - 0.05


def test_example_trains_like_the_single_gpu_run_gpu(tmp_path):
    require_gpu()
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONUNBUFFERED="1", FUSEMOE_WAIT_TIMEOUT_S=WAIT_TIMEOUT_S)
    ep = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={WORLD_SIZE}", os.path.join(EXAMPLES, "train_qwen3_moe_ep.py"),
         *EXAMPLE_ARGS, "--out", str(tmp_path / "ep")],
        env=env, capture_output=True, text=True, timeout=RANKS_TIMEOUT_S)
    print(ep.stdout[-4000:], ep.stderr[-4000:])
    assert ep.returncode == 0, f"the EP example failed:\n{ep.stderr[-4000:]}"
    single = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "train_qwen3_moe.py"), *EXAMPLE_ARGS,
         "--runs", "hf,fusemoe,hf_reordered", "--out", str(tmp_path / "single")],
        env=env, capture_output=True, text=True, timeout=RANKS_TIMEOUT_S)
    print(single.stdout[-4000:])
    assert single.returncode == 0, f"the single-GPU example failed:\n{single.stderr[-4000:]}"
    with open(tmp_path / "ep" / "train_qwen3_moe_ep.json") as f:
        ep_result = json.load(f)
    with open(tmp_path / "single" / "train_qwen3_moe.json") as f:
        single_result = json.load(f)
    assert ep_result["world_size"] == WORLD_SIZE
    check_example_against_single(ep_result, single_result["runs"])


def example_worker(rank, world_size, port, args):
    """One rank of the EP example on the CPU, as torchrun would start it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    expert_parallel._connect = cpu_connect
    register_cpu_kernels()
    register_cpu_ep_kernels()
    sys.path.insert(0, EXAMPLES)
    import train_qwen3_moe_ep
    assert train_qwen3_moe_ep.main(args) == 0


CPU_EXAMPLE_STEPS = ["--steps", "3"]  # the CPU's bf16 is slow


def test_example_trains_like_the_single_run_cpu_stand_ins(tmp_path):
    pytest.importorskip("transformers")
    register_cpu_kernels()
    sys.path.insert(0, EXAMPLES)
    import train_qwen3_moe
    out = str(tmp_path / "ep")
    args = [*EXAMPLE_ARGS, *CPU_EXAMPLE_STEPS, "--device", "cpu"]
    run_ranks_on_a_free_port(example_worker, tmp_path, [*args, "--out", out])
    assert train_qwen3_moe.main([*args, "--runs", "fusemoe", "--out",
                                 str(tmp_path / "single")]) == 0
    with open(os.path.join(out, "train_qwen3_moe_ep.json")) as f:
        ep_result = json.load(f)
    with open(tmp_path / "single" / "train_qwen3_moe.json") as f:
        single_runs = json.load(f)["runs"]
    # No noise-floor runs on the CPU (Hugging Face's experts there: not tried): the fixed bounds.
    check_example_against_single(ep_result, single_runs)


# ---- argument checks (no GPU, no group) ----

@pytest.mark.parametrize("args, message", [
    ((3, 8, 256, 128, 2, 64),
     r"the process group has 3 ranks; expert parallelism needs 1, 2, 4, 8"),
    ((4, 6, 256, 128, 2, 64), r"num_experts \(6\) must be divisible by the group's size \(4\)"),
    ((2, 8, 256, 128, 0, 64), r"top_k must be a positive int, got 0"),
    ((2, 8, 256, 128, 2, 0), r"max_tokens_per_rank must be a positive int, got 0"),
    ((2, 8, 256.0, 128, 2, 64), r"hidden_dim must be a positive int, got 256.0"),
    ((2, 8, 256, 128, 9, 64), r"top_k \(9\) must be <= num_experts \(8\)"),
])
def test_layer_checks_name_the_argument(args, message):
    with pytest.raises(ValueError, match=rf"^fusemoe.ExpertParallelMoEExperts: {message}"):
        expert_parallel.check_layer(*args)


@pytest.mark.parametrize("options, message", [
    (dict(precision="fp16"), r"precision must be \"bf16\" or \"fp8\", got 'fp16'"),
    (dict(precision="fp8", fp8_weight_grads=True),
     r"fp8_weight_grads=True is not supported with expert parallelism yet .*pass "
     r"fp8_weight_grads=False"),
    (dict(precision="bf16", fp8_weight_grads=True), r"fp8_weight_grads=True is not supported"),
    (dict(precision="fp8", fp8_weight_grads=1), r"fp8_weight_grads must be a bool, got 1"),
    (dict(precision="fp8", intermediate_dim=192),
     r"precision=\"fp8\" needs hidden and intermediate to be multiples of 128, got H=256, "
     r"I=192"),
])
def test_fp8_layer_checks_name_the_argument(options, message):
    args = dict(world_size=2, num_experts=8, hidden_dim=256, intermediate_dim=128, top_k=2,
                max_tokens_per_rank=64)
    args.update(options)
    with pytest.raises(ValueError, match=rf"^fusemoe.ExpertParallelMoEExperts: {message}"):
        expert_parallel.check_layer(**args)
    expert_parallel.check_layer(**dict(args, fp8_weight_grads=False, intermediate_dim=128,
                                       precision="fp8"))  # the same layer without the fault


@pytest.mark.parametrize("build", ["module", "from_experts"])
def test_fp8_weight_grads_is_refused_before_the_group(build):
    """The refusal names the argument and comes before any collective or memory (no group is
    initialized here)."""
    match = (r"^fusemoe.ExpertParallelMoEExperts: fp8_weight_grads=True is not supported with "
             r"expert parallelism yet")
    with pytest.raises(ValueError, match=match):
        if build == "module":
            fusemoe.ExpertParallelMoEExperts(8, 256, 128, 2, 64, device="cpu", precision="fp8",
                                             fp8_weight_grads=True)
        else:
            whole = types.SimpleNamespace(gate_up_proj=torch.zeros(8, 256, 256),
                                          down_proj=torch.zeros(8, 256, 128))
            fusemoe.ExpertParallelMoEExperts.from_experts(whole, 64, top_k=2, precision="fp8",
                                                          fp8_weight_grads=True)


FP8_CONTEXT_DIMS = (256, 128, 8, 2, 64)  # H, I, E, K, max tokens per rank


def fp8_arguments_worker(rank, world_size):
    """The ops' fp8_weights against the context's precision (CPU stand-ins): required at "fp8"
    with the size the library gives, refused at "bf16"; each message names the argument."""
    use_device("cpu", rank)
    hidden, intermediate, num_experts, top_k, max_tokens = FP8_CONTEXT_DIMS
    modules = {precision: fusemoe.ExpertParallelMoEExperts(
        num_experts, hidden, intermediate, top_k, max_tokens, device="cpu", precision=precision)
        for precision in ("bf16", "fp8")}
    assert modules["bf16"].context != modules["fp8"].context
    assert "precision='fp8'" in repr(modules["fp8"])
    local = num_experts // world_size
    x_TH = torch.zeros(4, hidden, dtype=torch.bfloat16)
    topk_idx_TK = torch.zeros(4, top_k, dtype=torch.int32)
    topk_weights_TK = torch.zeros(4, top_k)
    w13_LFH = modules["fp8"].gate_up_proj.detach()
    w2_LHI = modules["fp8"].down_proj.detach()
    expected = fp8_weights_bytes(local, hidden, intermediate)
    assert expert_parallel._context(modules["fp8"].context).config.fp8_weights_bytes == expected

    def forward(precision, fp8_weights):
        return expert_parallel.ep_moe_experts_forward(
            x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, modules[precision].context,
            False, False, fp8_weights)

    with pytest.raises(ValueError, match=r"precision=\"fp8\" needs fp8_weights, the buffer of "
                                         r"fusemoe.fp8.quantize_weights_fp8\(w13, w2\) of this "
                                         r"rank's experts"):
        forward("fp8", None)
    with pytest.raises(ValueError, match=rf"fp8_weights must be the buffer .* contiguous uint8 "
                                         rf"\[{expected}\] on cpu, got torch.uint8 \(100,\)"):
        forward("fp8", torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"fp8_weights must be None at precision='bf16'"):
        forward("bf16", torch.zeros(expected, dtype=torch.uint8))
    # Under fake tensors too (torch.compile traces these checks).
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(ValueError, match=r"needs fp8_weights"):
            forward("fp8", None)
        y_TH, _ = forward("fp8", torch.empty(expected, dtype=torch.uint8))
        assert tuple(y_TH.shape) == (4, hidden)


def test_fp8_op_arguments_are_checked_cpu_stand_ins(tmp_path):
    run_ranks(fp8_arguments_worker, tmp_path)


# (hosts, GPU uuid per rank, ALLOW_OVERLAPPING_DEVICES per rank, peer access, error or None)
REACH_CASES = {
    "two_hosts": (("node0", "node1"), ("A", "B"), (False, False), True,
                  r"the group's ranks are on 2 hosts \(node0, node1\)"),
    "shared_gpu_without_the_variable": (("n", "n"), ("A", "A"), (True, False), True,
                                        r"rank 1 shares its GPU with rank\(s\) \[0\]; .*"
                                        r"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1"),
    "shared_gpu": (("n", "n"), ("A", "A"), (True, True), True, None),
    "no_peer_access": (("n", "n"), ("A", "B"), (False, False), False,
                       r"rank 0's GPU \(cuda:0 there\) cannot access the memory of rank 1's GPU "
                       r"\(cuda:1 there\)"),
    "peers": (("n", "n"), ("A", "B"), (False, False), True, None),
}


def reach_worker(rank, world_size, case):
    """_check_ranks_reach_each_other with the host, the GPUs and peer access of `case` (torch.cuda
    and socket stand-ins): every rank raises the same error, or none does."""
    hosts, gpus, allow, access, error = REACH_CASES[case]
    visible = sorted(set(gpus))  # each rank sees every GPU of the case, as on one node
    torch.cuda.device_count = lambda: len(visible)
    torch.cuda.get_device_properties = lambda d: types.SimpleNamespace(
        uuid=visible[torch.device(d).index if isinstance(d, torch.device) else d])
    torch.cuda.can_device_access_peer = lambda i, j: access
    socket.gethostname = lambda: hosts[rank]
    if allow[rank]:
        os.environ[expert_parallel.ALLOW_OVERLAPPING_DEVICES] = "1"
    else:
        os.environ.pop(expert_parallel.ALLOW_OVERLAPPING_DEVICES, None)
    device = torch.device("cuda", visible.index(gpus[rank]))
    if error is None:
        expert_parallel._check_ranks_reach_each_other(dist.group.WORLD, device)
    else:
        with pytest.raises(fusemoe.FusemoeError, match=error):
            expert_parallel._check_ranks_reach_each_other(dist.group.WORLD, device)


@pytest.mark.parametrize("case", REACH_CASES)
def test_ranks_that_cannot_reach_each_other_are_refused_on_every_rank(case, tmp_path):
    run_ranks(reach_worker, tmp_path, case)


def test_module_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("skipped: a process group is already initialized in this process")
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        fusemoe.ExpertParallelMoEExperts(8, 256, 128, 2, 64, device="cpu")


def destroyed_group_worker(rank, world_size, store, device):
    """destroy_process_group frees the group although a layer's context was built on it (a group
    kept alive keeps gloo's threads running into interpreter exit, where a late one can abort the
    process); the layer then refuses calls, and a group initialized again gets a new context,
    whose building gives the old context's workspace back."""
    use_device(device, rank)
    tokens, dims, seed, _ = OP_CASES["even"]
    p = make_problem(sum(tokens), *dims, device, seed=seed)
    before, module = ep_outputs(rank, p, tokens, dims, False, device)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    gc.collect()
    assert group() is None, f"rank {rank}: the destroyed group is still referenced"
    rows = slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    with pytest.raises(ValueError, match="the process group this expert-parallel layer was built "
                                         "on was destroyed"):
        module(p["x_TH"][rows], p["topk_idx_TK"][rows], p["topk_weights_TK"][rows])
    dist.init_process_group("gloo", init_method=f"file://{store}-again", rank=rank,
                            world_size=world_size)
    got, again = ep_outputs(rank, p, tokens, dims, False, device)
    assert again.context != module.context
    assert expert_parallel._contexts[module.context].symmetric is None, (
        f"rank {rank}: the destroyed group's context still holds its workspace")
    assert expert_parallel._contexts[again.context].symmetric is not None
    for name in OUTPUTS:
        assert_bitwise(rank, f"{name} on the group initialized again", got[name], before[name])


def test_destroyed_group_is_freed_and_refused(tmp_path):
    run_ranks(destroyed_group_worker, tmp_path, str(tmp_path / "store"), "cpu")


def test_destroyed_group_is_freed_and_refused_gpu(tmp_path, monkeypatch):
    """The same with symmetric memory: the workspace given back on the device."""
    require_gpu()
    monkeypatch.setenv(expert_parallel.ALLOW_OVERLAPPING_DEVICES, "1")
    monkeypatch.setenv("FUSEMOE_WAIT_TIMEOUT_S", WAIT_TIMEOUT_S)
    run_ranks(destroyed_group_worker, tmp_path, str(tmp_path / "store"), "cuda")


def test_unknown_context_is_refused():
    with pytest.raises(ValueError, match="context 12345 is not an expert-parallel context"):
        expert_parallel._context(12345)
