"""Pure-PyTorch experts block for the tests: the fp32 oracle and the same-precision (bf16)
implementation the FlashAttention-3 tolerance rule compares against, plus CPU kernels that stand
in for the CUDA library in the CPU tests of the Python layer.

    z = W13_e x_t,  g = z[:I], u = z[I:],  h = silu(g) * u,  o = W2_e h,  y_t = sum_j w[t,j] o
    with a SwiGLU clamp c: g <- min(g, c), u <- clamp(u, -c, c) before h (torch.clamp's
    gradients: they pass where the bound is not active, bounds inclusive).

Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k, N rows of
one expert. Masked slots (expert id -1) are never visited, so their weight is never read.
"""
import math

import torch
import torch.nn.functional as F


def swiglu(z_NF, intermediate, swiglu_clamp=None):
    g_NI, u_NI = z_NF[:, :intermediate], z_NF[:, intermediate:]
    if swiglu_clamp is not None:
        g_NI = g_NI.clamp(max=swiglu_clamp)
        u_NI = u_NI.clamp(min=-swiglu_clamp, max=swiglu_clamp)
    return F.silu(g_NI) * u_NI


def moe_experts_torch(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, swiglu_clamp=None):
    """Per-expert loop in the dtype of x and the weights (z, h, o rounded to it), routing weights
    applied and rows summed in fp32, y rounded once: a careful PyTorch layer. Differentiable."""
    num_tokens, hidden = x_TH.shape
    num_experts, two_intermediate, _ = w13_EFH.shape
    intermediate = two_intermediate // 2
    y_TH = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x_TH.device)
    for e in range(num_experts):
        token_N, slot_N = (topk_idx_TK == e).nonzero(as_tuple=True)
        if token_N.numel() == 0:
            continue
        z_NF = x_TH[token_N] @ w13_EFH[e].t()
        h_NI = swiglu(z_NF, intermediate, swiglu_clamp)
        o_NH = h_NI @ w2_EHI[e].t()
        w_N = topk_weights_TK[token_N, slot_N].float()
        y_TH = y_TH.index_add(0, token_N, o_NH.float() * w_N[:, None])
    return y_TH.to(x_TH.dtype)


def moe_experts_backward_fp32(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI,
                              swiglu_clamp=None):
    """Closed-form backward in fp32 (no autograd): dx, d_topk_weights, dw13, dw2.
    d_topk_w = <h, a> with a = dy W2_e; dh = w a; dg = dh u silu'(g); du = dh silu(g)
    (g, u clamped; dg, du zero where their bound is active)."""
    x_TH, dy_TH, w13_EFH, w2_EHI = (t.float() for t in (x_TH, dy_TH, w13_EFH, w2_EHI))
    num_experts, two_intermediate, _ = w13_EFH.shape
    intermediate = two_intermediate // 2
    dx_TH = torch.zeros_like(x_TH)
    d_topk_weights_TK = torch.zeros(topk_idx_TK.shape, dtype=torch.float32, device=x_TH.device)
    dw13_EFH = torch.zeros_like(w13_EFH)
    dw2_EHI = torch.zeros_like(w2_EHI)
    for e in range(num_experts):
        token_N, slot_N = (topk_idx_TK == e).nonzero(as_tuple=True)
        if token_N.numel() == 0:
            continue
        x_NH, dy_NH = x_TH[token_N], dy_TH[token_N]
        w_N = topk_weights_TK[token_N, slot_N].float()
        z_NF = x_NH @ w13_EFH[e].t()
        g_NI, u_NI = z_NF[:, :intermediate], z_NF[:, intermediate:]
        g_pass_NI = u_pass_NI = torch.ones_like(g_NI)
        if swiglu_clamp is not None:
            g_pass_NI = (g_NI <= swiglu_clamp).float()
            u_pass_NI = ((u_NI >= -swiglu_clamp) & (u_NI <= swiglu_clamp)).float()
            g_NI = g_NI.clamp(max=swiglu_clamp)
            u_NI = u_NI.clamp(min=-swiglu_clamp, max=swiglu_clamp)
        sig_NI = torch.sigmoid(g_NI)
        silu_NI = g_NI * sig_NI
        h_NI = silu_NI * u_NI
        a_NI = dy_NH @ w2_EHI[e]
        d_topk_weights_TK[token_N, slot_N] = (h_NI * a_NI).sum(dim=1)
        dh_NI = w_N[:, None] * a_NI
        dg_NI = dh_NI * u_NI * sig_NI * (1 + g_NI * (1 - sig_NI)) * g_pass_NI
        dz_NF = torch.cat([dg_NI, dh_NI * silu_NI * u_pass_NI], dim=1)
        dx_TH.index_add_(0, token_N, dz_NF @ w13_EFH[e])
        dw13_EFH[e] = dz_NF.t() @ x_NH
        dw2_EHI[e] = (w_N[:, None] * dy_NH).t() @ h_NI
    return dx_TH, d_topk_weights_TK, dw13_EFH, dw2_EHI


_registered = set()  # PyTorch refuses a second Python kernel for an op defined in C++ (native)


def _once(register):
    """register() runs once per process, whichever test modules ask for it."""
    def run():
        if register.__name__ not in _registered:
            _registered.add(register.__name__)
            register()
    run.__doc__ = register.__doc__
    return run


# The accumulate flag of every call of a stand-in _into op (the backward of grad_in_place), in
# order: how tests see that path taken, whichever autograd formula (Python or C++) called it.
into_accumulate_flags = []
# (gate_up_grad, down_grad) of every call of a stand-in backward op of fresh gradients, in order:
# which weight gradients a formula asked for (frozen weights ask for none).
weight_grad_requests = []
# (op, fp8_weight_grads) of every call of a stand-in FP8 op ("forward", "backward",
# "backward_into"), in order: what reached the ops of the option, whichever formula called them.
fp8_weight_grads_calls = []


def fresh_weight_grads(grads, weights, gate_up_grad, down_grad):
    """What a stand-in backward op of fresh gradients returns for computed grads of weights (w13,
    w2 or w1, w3, w2): each in its weight's dtype, or a 0-element tensor when not asked for (as
    the library's ops); records the request."""
    from fusemoe import ops
    weight_grad_requests.append((gate_up_grad, down_grad))
    wanted = ops._wanted_per_weight(len(weights), gate_up_grad, down_grad)
    return ops._returned_weight_grads(
        tuple(g.to(w.dtype) if want else None for g, w, want in zip(grads, weights, wanted)),
        weights)


@_once
def register_cpu_kernels():
    """CPU kernels for the fusemoe ops (fp32 math, outputs in the op's dtypes), so the Python
    layer (autograd, fake kernels, torch.compile, checkpointing) can be tested without a GPU.
    Like the CUDA kernels they validate their arguments with fusemoe.ops._check_inputs first.
    The ops' own kernels (native or ctypes) serve every backend; these take CPU tensors."""
    from fusemoe.ops import _check_inputs, _empty_saved_z

    @torch.library.register_kernel("fusemoe::moe_experts_forward", "cpu")
    def _forward_cpu(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                     grad_in_place=False, save_z=False, swiglu_clamp=None):
        dims = _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI)
        y_TH = moe_experts_torch(x_TH.float(), topk_idx_TK, topk_weights_TK, w13_EFH.float(),
                                 w2_EHI.float(), swiglu_clamp)
        # z's layout is the library's own (an opaque buffer): zeros of its shape here, and the
        # CPU backward recomputes.
        return y_TH.to(x_TH.dtype), _empty_saved_z(x_TH, dims, save_z).zero_()

    @torch.library.register_kernel("fusemoe::moe_experts_backward", "cpu")
    def _backward_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, impl,
                      saved_z_SF=None, swiglu_clamp=None, gate_up_grad=True, down_grad=True):
        _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH)
        dx_TH, dw_TK, dw13_EFH, dw2_EHI = moe_experts_backward_fp32(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, swiglu_clamp)
        return (dx_TH.to(x_TH.dtype), dw_TK,
                *fresh_weight_grads((dw13_EFH, dw2_EHI), (w13_EFH, w2_EHI), gate_up_grad, down_grad))

    @torch.library.register_kernel("fusemoe::moe_experts_backward_into", "cpu")
    def _backward_into_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dw13_EFH,
                           dw2_EHI, accumulate, impl, saved_z_SF=None, swiglu_clamp=None):
        into_accumulate_flags.append(accumulate)
        _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH)
        dx_TH, dw_TK, g13_EFH, g2_EHI = moe_experts_backward_fp32(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, swiglu_clamp)
        for out, grad in ((dw13_EFH, g13_EFH), (dw2_EHI, g2_EHI)):
            add_into(out, grad, accumulate)
        return dx_TH.to(x_TH.dtype), dw_TK

    # Separate gate and up weights (fusemoe.separate): the same math on [w1; w3] per expert. The
    # concatenation is this stand-in's, inside the kernel; the library reads w1 and w3 in place.
    from fusemoe.separate import _check_inputs_w1w3, _check_weight_grads_w1w3

    @torch.library.register_kernel("fusemoe::moe_experts_w1w3_forward", "cpu")
    def _forward_w1w3_cpu(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, impl,
                          grad_in_place=False, save_z=False, swiglu_clamp=None):
        dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
        w13_EFH = torch.cat([w1_EIH, w3_EIH], dim=1)
        y_TH = moe_experts_torch(x_TH.float(), topk_idx_TK, topk_weights_TK, w13_EFH.float(),
                                 w2_EHI.float(), swiglu_clamp)
        return y_TH.to(x_TH.dtype), _empty_saved_z(x_TH, dims, save_z).zero_()

    @torch.library.register_kernel("fusemoe::moe_experts_w1w3_backward", "cpu")
    def _backward_w1w3_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                           impl, saved_z_SF=None, swiglu_clamp=None, gate_up_grad=True,
                           down_grad=True):
        _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH)
        dx_TH, dw_TK, dw13_EFH, dw2_EHI = moe_experts_backward_fp32(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, torch.cat([w1_EIH, w3_EIH], dim=1), w2_EHI,
            swiglu_clamp)
        intermediate = w1_EIH.shape[1]
        grads = (dw13_EFH[:, :intermediate], dw13_EFH[:, intermediate:], dw2_EHI)
        return (dx_TH.to(x_TH.dtype), dw_TK,
                *fresh_weight_grads(grads, (w1_EIH, w3_EIH, w2_EHI), gate_up_grad, down_grad))

    @torch.library.register_kernel("fusemoe::moe_experts_w1w3_backward_into", "cpu")
    def _backward_into_w1w3_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                                dw1_EIH, dw3_EIH, dw2_EHI, accumulate, impl, saved_z_SF=None,
                                swiglu_clamp=None):
        into_accumulate_flags.append(accumulate)
        _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, dy_TH)
        _check_weight_grads_w1w3(dw1_EIH, dw3_EIH, dw2_EHI, w1_EIH, w3_EIH, w2_EHI)
        return backward_into_w1w3(dy_TH, x_TH, topk_idx_TK, topk_weights_TK,
                                  torch.cat([w1_EIH, w3_EIH], dim=1), w2_EHI,
                                  (dw1_EIH, dw3_EIH, dw2_EHI), accumulate, swiglu_clamp)


def backward_into_w1w3(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, weight_grads,
                       accumulate, swiglu_clamp):
    """The _into stand-ins of fusemoe.separate on w13 = [w1; w3]: dw13's halves and dw2 written or
    added into weight_grads (dw1, dw3, dw2) as the w13 stand-ins and the kernels (add_into).
    Returns (dx, d_topk_weights)."""
    dx_TH, dw_TK, g13_EFH, g2_EHI = moe_experts_backward_fp32(
        dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, swiglu_clamp)
    intermediate = w13_EFH.shape[1] // 2
    grads = (g13_EFH[:, :intermediate], g13_EFH[:, intermediate:], g2_EHI)
    for out, grad in zip(weight_grads, grads):
        add_into(out, grad, accumulate)
    return dx_TH.to(x_TH.dtype), dw_TK


def add_into(out, grad_fp32, accumulate):
    """What the weight-gradient kernels do with a gradient and its buffer: written, or added as
    the kernels' TMA reduce-add does, in the buffer's dtype (fp32: one add; bf16: the gradient
    rounded to bf16 first, as autograd's add of a bf16 gradient into a bf16 .grad)."""
    if accumulate:
        out.add_(grad_fp32.to(out.dtype))
    else:
        out.copy_(grad_fp32)


def fp8_stand_in_weights(fp8_weights, w13_EFH, w2_EHI):
    """The bf16 weights the CPU stand-in of fusemoe::quantize_weights_fp8 stored in an FP8 weight
    buffer (views of it; the buffer checked against w13/w2's shapes first)."""
    from fusemoe._checks import _check_fp8_weights
    _check_fp8_weights(fp8_weights, w13_EFH, w2_EHI)
    n13, n2 = 2 * w13_EFH.numel(), 2 * w2_EHI.numel()
    return (fp8_weights[:n13].view(torch.bfloat16).view(w13_EFH.shape),
            fp8_weights[n13:n13 + n2].view(torch.bfloat16).view(w2_EHI.shape))


@_once
def register_cpu_fp8_kernels():
    """CPU stand-ins for the FP8 ops (precision="fp8"), for the CPU tests of the Python layer's
    FP8 weight cache: fusemoe::quantize_weights_fp8 stores the bf16 weights themselves in the
    buffer (it has room: fp8_weights_bytes >= 2 bytes per weight), and the forward and backward
    read the weights back from that buffer, never from w13/w2 (as the library's FP8 ops do not),
    so a stale buffer gives wrong outputs. The math is the bf16 stand-ins', not FP8's."""
    from fusemoe._checks import _check_fp8_shapes, _check_tensor, fp8_weights_bytes
    from fusemoe.ops import _check_inputs, _empty_saved_z
    weights_of = fp8_stand_in_weights

    @torch.library.register_kernel("fusemoe::quantize_weights_fp8", "cpu")
    def _quantize_cpu(w13_EFH, w2_EHI):
        _check_tensor(w13_EFH, "w13 (gate_up_proj)", 3, torch.bfloat16)
        _check_tensor(w2_EHI, "w2 (down_proj)", 3, torch.bfloat16)
        buffer = torch.zeros(fp8_weights_bytes(*_check_fp8_shapes(w13_EFH, w2_EHI)),
                             dtype=torch.uint8)
        w13_copy, w2_copy = weights_of(buffer, w13_EFH, w2_EHI)
        w13_copy.copy_(w13_EFH)
        w2_copy.copy_(w2_EHI)
        return buffer

    @torch.library.register_kernel("fusemoe::moe_experts_fp8_forward", "cpu")
    def _forward_cpu(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, fp8_weights, impl,
                     grad_in_place=False, save_z=False, swiglu_clamp=None, fp8_weight_grads=False):
        fp8_weight_grads_calls.append(("forward", fp8_weight_grads))
        dims = _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI)
        w13, w2 = weights_of(fp8_weights, w13_EFH, w2_EHI)
        y_TH = moe_experts_torch(x_TH.float(), topk_idx_TK, topk_weights_TK, w13.float(),
                                 w2.float(), swiglu_clamp)
        return y_TH.to(x_TH.dtype), _empty_saved_z(x_TH, dims, save_z).zero_()

    @torch.library.register_kernel("fusemoe::moe_experts_fp8_backward", "cpu")
    def _backward_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, fp8_weights,
                      impl, saved_z_SF=None, swiglu_clamp=None, gate_up_grad=True, down_grad=True,
                      fp8_weight_grads=False):
        fp8_weight_grads_calls.append(("backward", fp8_weight_grads))
        _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH)
        w13, w2 = weights_of(fp8_weights, w13_EFH, w2_EHI)
        dx_TH, dw_TK, dw13_EFH, dw2_EHI = moe_experts_backward_fp32(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13, w2, swiglu_clamp)
        return (dx_TH.to(x_TH.dtype), dw_TK,
                *fresh_weight_grads((dw13_EFH, dw2_EHI), (w13_EFH, w2_EHI), gate_up_grad, down_grad))

    @torch.library.register_kernel("fusemoe::moe_experts_fp8_backward_into", "cpu")
    def _backward_into_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI,
                           fp8_weights, dw13_EFH, dw2_EHI, accumulate, impl, saved_z_SF=None,
                           swiglu_clamp=None, fp8_weight_grads=False):
        fp8_weight_grads_calls.append(("backward_into", fp8_weight_grads))
        into_accumulate_flags.append(accumulate)
        _check_inputs(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH)
        w13, w2 = weights_of(fp8_weights, w13_EFH, w2_EHI)
        dx_TH, dw_TK, g13_EFH, g2_EHI = moe_experts_backward_fp32(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13, w2, swiglu_clamp)
        for out, grad in ((dw13_EFH, g13_EFH), (dw2_EHI, g2_EHI)):
            add_into(out, grad, accumulate)
        return dx_TH.to(x_TH.dtype), dw_TK


@_once
def register_cpu_fp8_w1w3_kernels():
    """CPU stand-ins for fusemoe.separate's FP8 ops, as register_cpu_fp8_kernels' (whose kernels
    they use): fusemoe::quantize_weights_fp8_w1w3 writes the buffer the w13 stand-in writes for
    [w1; w3] (the library's overload writes the same bytes), and the ops read the weights back
    from it, never from w1, w3, w2."""
    register_cpu_fp8_kernels()
    from fusemoe.separate import (_check_fp8_buffer_w1w3, _check_inputs_w1w3,
                                  _check_quantize_inputs, _check_weight_grads_w1w3)
    from fusemoe.ops import _empty_saved_z

    def weights_of(fp8_weights, dims, w1_EIH, w2_EHI):
        _check_fp8_buffer_w1w3(fp8_weights, dims, w1_EIH.device)
        num_experts, intermediate, hidden = w1_EIH.shape
        n13, n2 = 2 * 2 * w1_EIH.numel(), 2 * w2_EHI.numel()
        return (fp8_weights[:n13].view(torch.bfloat16).view(num_experts, 2 * intermediate, hidden),
                fp8_weights[n13:n13 + n2].view(torch.bfloat16).view(w2_EHI.shape))

    @torch.library.register_kernel("fusemoe::quantize_weights_fp8_w1w3", "cpu")
    def _quantize_cpu(w1_EIH, w3_EIH, w2_EHI):
        _check_quantize_inputs(w1_EIH, w3_EIH, w2_EHI)
        return torch.ops.fusemoe.quantize_weights_fp8(torch.cat([w1_EIH, w3_EIH], dim=1), w2_EHI)

    @torch.library.register_kernel("fusemoe::moe_experts_w1w3_fp8_forward", "cpu")
    def _forward_cpu(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI, fp8_weights,
                     impl, grad_in_place=False, save_z=False, swiglu_clamp=None,
                     fp8_weight_grads=False):
        fp8_weight_grads_calls.append(("forward", fp8_weight_grads))
        dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI)
        w13, w2 = weights_of(fp8_weights, dims, w1_EIH, w2_EHI)
        y_TH = moe_experts_torch(x_TH.float(), topk_idx_TK, topk_weights_TK, w13.float(),
                                 w2.float(), swiglu_clamp)
        return y_TH.to(x_TH.dtype), _empty_saved_z(x_TH, dims, save_z).zero_()

    def backward_into(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                      fp8_weights, weight_grads, accumulate, swiglu_clamp):
        dims = _check_inputs_w1w3(x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                                  dy_TH)
        _check_weight_grads_w1w3(*weight_grads, w1_EIH, w3_EIH, w2_EHI)
        w13, w2 = weights_of(fp8_weights, dims, w1_EIH, w2_EHI)
        return backward_into_w1w3(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13, w2,
                                  weight_grads, accumulate, swiglu_clamp)

    @torch.library.register_kernel("fusemoe::moe_experts_w1w3_fp8_backward", "cpu")
    def _backward_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                      fp8_weights, impl, saved_z_SF=None, swiglu_clamp=None, gate_up_grad=True,
                      down_grad=True, fp8_weight_grads=False):
        fp8_weight_grads_calls.append(("backward", fp8_weight_grads))
        weights = (w1_EIH, w3_EIH, w2_EHI)
        grads = tuple(torch.empty_like(w) for w in weights)
        dx_and_dw = backward_into(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, *weights,
                                  fp8_weights, grads, False, swiglu_clamp)
        return dx_and_dw + fresh_weight_grads(grads, weights, gate_up_grad, down_grad)

    @torch.library.register_kernel("fusemoe::moe_experts_w1w3_fp8_backward_into", "cpu")
    def _backward_into_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                           fp8_weights, dw1_EIH, dw3_EIH, dw2_EHI, accumulate, impl,
                           saved_z_SF=None, swiglu_clamp=None, fp8_weight_grads=False):
        fp8_weight_grads_calls.append(("backward_into", fp8_weight_grads))
        into_accumulate_flags.append(accumulate)
        return backward_into(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w1_EIH, w3_EIH, w2_EHI,
                             fp8_weights, (dw1_EIH, dw3_EIH, dw2_EHI), accumulate, swiglu_clamp)


def make_problem(num_tokens, hidden, intermediate, num_experts, top_k, device, seed=0,
                 routing="uniform"):
    """bf16 x ~ N(0,1), w13 ~ N(0,1/H), w2 ~ N(0,1/I), dy ~ N(0,1); int32 ids of K distinct
    experts per token ("uniform") or of expert 0 only ("one_expert"); fp32 softmax weights."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    x_TH = randn(num_tokens, hidden)
    w13_EFH = randn(num_experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
    w2_EHI = randn(num_experts, hidden, intermediate, scale=intermediate ** -0.5)
    dy_TH = randn(num_tokens, hidden)
    if routing == "uniform":
        topk_idx_TK = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=1).indices
    else:
        topk_idx_TK = torch.zeros(num_tokens, top_k, dtype=torch.int64)
    topk_weights_TK = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=1)
    return dict(x_TH=x_TH, topk_idx_TK=topk_idx_TK.to(torch.int32).to(device),
                topk_weights_TK=topk_weights_TK.to(device), w13_EFH=w13_EFH, w2_EHI=w2_EHI,
                dy_TH=dy_TH)


def split_w13(w13_EFH):
    """w13 [E, 2I, H] as the separate gate and up weights (w1, w3) [E, I, H], contiguous."""
    intermediate = w13_EFH.shape[1] // 2
    return w13_EFH[:, :intermediate].contiguous(), w13_EFH[:, intermediate:].contiguous()


SEPARATE_OUTPUTS = ("y", "dx", "d_topk_weights", "dw1", "dw3", "dw2")  # separate_and_w13's order


def separate_and_w13(p, micro_batches=1, **options):
    """y and every gradient of fusemoe.moe_experts_w1w3 and of fusemoe.moe_experts on
    w13 = [w1; w3] with the same options, over micro_batches backward passes (x flipped every
    other one) into the same leaves: (separate, concatenated), each [y, dx, d_topk_weights, dw1,
    dw3, dw2] with w13's gradient split; y is the last micro-batch's."""
    import fusemoe

    def leaves(*tensors):
        return [t.clone().requires_grad_() for t in tensors]

    x, w, w1, w3, w2 = leaves(p["x_TH"], p["topk_weights_TK"], p["w1_EIH"], p["w3_EIH"],
                              p["w2_EHI"])
    x_ref, w_ref, w13_ref, w2_ref = leaves(p["x_TH"], p["topk_weights_TK"], p["w13_EFH"],
                                           p["w2_EHI"])
    idx, dy = p["topk_idx_TK"], p["dy_TH"]
    for batch in range(micro_batches):
        flip = (lambda t: t.flip(0)) if batch % 2 else (lambda t: t)
        y = fusemoe.moe_experts_w1w3(flip(x), idx, w, w1, w3, w2, **options)
        y.backward(dy)
        y_ref = fusemoe.moe_experts(flip(x_ref), idx, w_ref, w13_ref, w2_ref, **options)
        y_ref.backward(dy)
    return ([y.detach(), x.grad, w.grad, w1.grad, w3.grad, w2.grad],
            [y_ref.detach(), x_ref.grad, w_ref.grad, *split_w13(w13_ref.grad), w2_ref.grad])


def rel_err(got, ref):
    """Relative L2 error ||got - ref|| / ||ref|| in fp64 (0 when both are zero; inf when either
    holds a NaN or an inf). inf passes a bound that is itself inf, so a check whose bound comes
    from another rel_err must also require math.isfinite (assert_within_noise does)."""
    got, ref = got.double(), ref.double()
    diff = torch.linalg.vector_norm(got - ref).item()
    norm = torch.linalg.vector_norm(ref).item()
    if not (math.isfinite(diff) and math.isfinite(norm)):
        return float("inf")
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def calc_diff(got, ref):
    """DeepGEMM's 1 - 2<x,y>/(<x,x> + <y,y>): 0 when identical."""
    got, ref = got.double(), ref.double()
    denom = (got * got + ref * ref).sum().item()
    return 1 - 2 * (got * ref).sum().item() / denom if denom > 0 else 0.0


OUTPUTS = ("y", "dx", "d_topk_weights", "dw13", "dw2")


def run_layer(fn, p, dtype):
    """OUTPUTS of experts function fn on problem p (make_problem) with its inputs in dtype
    (topk_weights stay fp32): y and the gradients of x, topk_weights, w13, w2 for upstream
    gradient dy."""
    leaves = [p[k].to(dtype if k != "topk_weights_TK" else torch.float32).clone().requires_grad_()
              for k in ("x_TH", "topk_weights_TK", "w13_EFH", "w2_EHI")]
    y = fn(leaves[0], p["topk_idx_TK"], leaves[1], leaves[2], leaves[3])
    y.backward(p["dy_TH"].to(dtype))
    return dict(zip(OUTPUTS, [y.detach()] + [leaf.grad for leaf in leaves]))


def assert_within_noise(rows, atol, noise_name, prefix=""):
    """The FlashAttention-3 rule on rows (name, got, noise, ref): rel_err(got, ref) <=
    2 * rel_err(noise, ref) + atol, noise being the same-precision run of another implementation.
    Both errors must be finite (a NaN or inf in got, noise or ref fails: an infinite noise error
    would make the tolerance inf). Prints every row, then fails naming the rows that miss."""
    report, failures = [], []
    for name, got, noise, ref in rows:
        err, noise_err = rel_err(got, ref), rel_err(noise, ref)
        tol = 2 * noise_err + atol
        report.append(f"{prefix}{name}: fusemoe {err:.2e} (calc_diff {calc_diff(got, ref):.2e}), "
                      f"{noise_name} {noise_err:.2e}, tol {tol:.2e}")
        if not (math.isfinite(err) and math.isfinite(noise_err) and err <= tol):
            failures.append(report[-1])
    print("\n".join(report))
    assert not failures, "\n".join(failures)


def cpu_connect(group, device, num_bytes):
    """Stands in for fusemoe.expert_parallel._connect on the CPU (tests monkeypatch it): no
    symmetric memory, null peers; the CPU expert-parallel kernels below talk over the group."""
    import torch.distributed as dist
    if device.type != "cpu":
        raise ValueError(f"cpu_connect serves CPU modules only, got {device}")
    return torch.empty(0, dtype=torch.uint8), None, [0] * dist.get_world_size(group)


def register_cpu_ep_kernels():
    """CPU kernels for the expert-parallel ops (with cpu_connect): every rank gathers every
    rank's tokens and experts over the context's gloo group, computes the whole layer on the
    concatenated batch (rank 0's tokens first) in fp32 as the CPU kernels above do, and keeps its
    own tokens' rows and its own experts' weight gradients: the contract of the CUDA layer, so
    the module, autograd, the fake kernels and the training example can be tested without a GPU.
    They validate their arguments with the ops' own checks first. At precision "fp8" they read
    each rank's weights back from its FP8 weight buffer (register_cpu_fp8_kernels' stand-in
    stores the bf16 weights there), never from w13/w2, as the library does not: a stale buffer
    gives wrong outputs. The math stays fp32, not FP8's."""
    import torch.distributed as dist
    from fusemoe import expert_parallel as ep

    register_cpu_fp8_kernels()  # the FP8 weight buffer's stand-in

    def local_weights(w13_LFH, w2_LHI, fp8_weights):
        """This rank's weights as the layer reads them: from the FP8 buffer when given."""
        if fp8_weights is None:
            return w13_LFH, w2_LHI
        return fp8_stand_in_weights(fp8_weights, w13_LFH, w2_LHI)

    def clamp_of(ctx):
        layer = ctx.config.layer
        return layer.swiglu_clamp if layer.use_swiglu_clamp else None

    def gathered(ctx, *tensors):
        """Every rank's tensors, concatenated in rank order (dim 0), and this rank's first row."""
        per_rank = [None] * dist.get_world_size(ctx.group)
        dist.all_gather_object(per_rank, tensors, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        first = sum(ts[0].shape[0] for ts in per_rank[:rank])
        return [torch.cat([ts[i] for ts in per_rank]) for i in range(len(tensors))], first

    @torch.library.register_kernel("fusemoe::ep_moe_experts_forward", "cpu")
    def _forward_cpu(x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context, save_z,
                     grad_in_place=False, fp8_weights=None):
        ctx, num_tokens = ep._check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH,
                                         w2_LHI, fp8_weights=fp8_weights)
        (x, idx, w), first = gathered(ctx, x_TH, topk_idx_TK, topk_weights_TK)
        (w13, w2), _ = gathered(ctx, *local_weights(w13_LFH, w2_LHI, fp8_weights))
        y_TH = moe_experts_torch(x.float(), idx, w, w13.float(), w2.float(),
                                 clamp_of(ctx))[first:first + num_tokens]
        return y_TH.to(x_TH.dtype), ep._empty_saved_state(x_TH, ctx, save_z).zero_()

    def backward_fp32(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context,
                      saved_state, fp8_weights):
        """This rank's dx, d_topk_weights and (fp32) weight gradients of its experts."""
        ctx, num_tokens = ep._check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH,
                                         w2_LHI, dy_TH, fp8_weights)
        ep._check_saved_state(ctx, saved_state, x_TH)
        (dy, x, idx, w), first = gathered(ctx, dy_TH, x_TH, topk_idx_TK, topk_weights_TK)
        (w13, w2), _ = gathered(ctx, *local_weights(w13_LFH, w2_LHI, fp8_weights))
        dx, dw, dw13, dw2 = moe_experts_backward_fp32(dy, x, idx, w, w13, w2, clamp_of(ctx))
        local = w13_LFH.shape[0]
        experts = slice(dist.get_rank(ctx.group) * local, (dist.get_rank(ctx.group) + 1) * local)
        tokens = slice(first, first + num_tokens)
        return dx[tokens].to(x_TH.dtype), dw[tokens], dw13[experts], dw2[experts]

    @torch.library.register_kernel("fusemoe::ep_moe_experts_backward", "cpu")
    def _backward_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context,
                      saved_state=None, gate_up_grad=True, down_grad=True, fp8_weights=None):
        dx, dw, dw13, dw2 = backward_fp32(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH,
                                          w2_LHI, context, saved_state, fp8_weights)
        return (dx, dw, *fresh_weight_grads((dw13, dw2), (w13_LFH, w2_LHI), gate_up_grad,
                                            down_grad))

    @torch.library.register_kernel("fusemoe::ep_moe_experts_backward_into", "cpu")
    def _backward_into_cpu(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dw13_LFH,
                           dw2_LHI, accumulate, context, saved_state=None, fp8_weights=None):
        from fusemoe import ops
        ops._check_weight_grads(dw13_LFH, dw2_LHI, w13_LFH, w2_LHI, ep.API)
        dx, dw, dw13, dw2 = backward_fp32(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH,
                                          w2_LHI, context, saved_state, fp8_weights)
        for out, grad in ((dw13_LFH, dw13), (dw2_LHI, dw2)):
            add_into(out, grad, accumulate)
        return dx, dw
