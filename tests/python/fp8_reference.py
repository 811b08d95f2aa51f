"""FP8 emulation reference in PyTorch (issue 16): the blockwise recipe of precision="fp8"
(docs/numerics.md, "Blockwise FP8"), then fp32 math, with the bf16 roundings where the kernels
materialise bf16 values. Mirrors reference/fp8_emulation.cpp (the C++ suite's, fp64 between).

    scale = max(amax, 1e-30) / 448 per block (1 x 128 activations, 128 x 128 weights),
    q = e4m3(v * 448 / amax), dequantized q * scale.
Forward: z = dq(x) dq(W13)^T, h = bf16(silu(g) u), o = dq(h) dq(W2)^T, y = bf16(sum_j bf16(w o)).
Backward (straight-through): a = dq(dy) dq(W2), h from bf16 z, d_topk_w = <h, a>,
dz = bf16(SwiGLU'(w a)), dx = bf16(sum_j bf16(dq(dz) dq(W13))), dW2 = dy^T bf16(w h), dW13 = dz^T x;
with fp8_weight_grads, dW2 = dq_t(dy)^T dq_tt(bf16(w h)) and dW13 = dq_t(dz)^T dq_tt(x) over each
expert's rows in slot order, blocked from its first row (the last block padded with zeros): dq_t
one scale per feature and 128 rows, dq_tt one per 128 features x 128 rows.
With a SwiGLU clamp c, g <- min(g, c) and u <- clamp(u, -c, c) before h, and dg, du are zero where
their bound is active (as moe_reference.py and the kernels' epilogues).
Shape legend: T tokens, H hidden, I expert intermediate, F = 2I, E experts, K top-k, N rows of
one expert.
"""
import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
MIN_AMAX = 1e-30
BLOCK = 128


def _quantize_blocks(blocks, dims):
    """Dequantized E4M3 values of `blocks` with one scale per block (max over dims)."""
    amax = blocks.abs().amax(dim=dims, keepdim=True).clamp_min(MIN_AMAX)
    # Tensor by tensor, as the kernels divide (IEEE fp32): `E4M3_MAX / amax` is amax.reciprocal()
    # * 448 in PyTorch, which differs in the last bit for ~1 in 4 values and so breaks the ties of
    # the E4M3 rounding otherwise than the kernels (the emulation then sat ~2e-2 from them).
    # In fp32 whatever the working dtype: the recipe is the kernels' (the values are bf16, so
    # amax is exact in fp32, and v * inv is rounded to fp32 before the E4M3 rounding, as there).
    blocks32, amax = blocks.float(), amax.float()
    max_value = torch.full_like(amax, E4M3_MAX)
    scale, inv = amax / max_value, max_value / amax
    q = (blocks32 * inv).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(blocks.dtype) * scale.to(blocks.dtype)


def quantize_rows(v_NC):
    """1 x 128 blocks along the last dimension of an fp32 (or fp64) [N, C] tensor."""
    n, c = v_NC.shape
    return _quantize_blocks(v_NC.reshape(n, c // BLOCK, BLOCK), (-1,)).reshape(n, c)


def quantize_matrix(w_RC):
    """128 x 128 blocks of an fp32 [R, C] matrix."""
    r, c = w_RC.shape
    blocks = w_RC.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
    return _quantize_blocks(blocks, (1, 3)).reshape(r, c)


def quantize_token_blocks(v_NC, blocks_128x128):
    """The weight gradients' token-blocked quantization (fp8_weight_grads) of one expert's fp32
    [N, C] rows: blocks of 128 rows from the first, each column alone or 128 columns together."""
    n, c = v_NC.shape
    padded = -(-n // BLOCK) * BLOCK
    v = torch.zeros(padded, c, dtype=v_NC.dtype, device=v_NC.device)
    v[:n] = v_NC
    blocks = v.reshape(padded // BLOCK, BLOCK, c // BLOCK, BLOCK)
    return _quantize_blocks(blocks, (1, 3) if blocks_128x128 else (1,)).reshape(padded, c)[:n]


def _bf16(t):
    return t.to(torch.bfloat16).to(t.dtype)


def _clamped(z_NF, intermediate, swiglu_clamp):
    """g, u (clamped when swiglu_clamp is set) and the masks where their gradient passes."""
    g_NI, u_NI = z_NF[:, :intermediate], z_NF[:, intermediate:]
    if swiglu_clamp is None:
        ones_NI = torch.ones_like(g_NI)
        return g_NI, u_NI, ones_NI, ones_NI
    g_pass_NI = (g_NI <= swiglu_clamp).to(z_NF.dtype)
    u_pass_NI = ((u_NI >= -swiglu_clamp) & (u_NI <= swiglu_clamp)).to(z_NF.dtype)
    return (g_NI.clamp(max=swiglu_clamp), u_NI.clamp(min=-swiglu_clamp, max=swiglu_clamp),
            g_pass_NI, u_pass_NI)


def moe_experts_fp8_emulated(x_TH, topk_idx_TK, topk_weights_TK, w13_EFH, w2_EHI, dy_TH,
                             swiglu_clamp=None, fp8_weight_grads=False, dtype=torch.float32):
    """y and every gradient (dict: y, dx, d_topk_weights, dw13, dw2) of the FP8 recipe, its math
    in dtype: fp32 for the GPU tests, fp64 for the twin that bounds fp32's own rounding (the
    quantization is the same fp32 recipe in both)."""
    x_TH, dy_TH = x_TH.to(dtype), dy_TH.to(dtype)
    num_tokens, hidden = x_TH.shape
    num_experts, two_intermediate, _ = w13_EFH.shape
    intermediate = two_intermediate // 2
    xq_TH, dyq_TH = quantize_rows(x_TH), quantize_rows(dy_TH)
    y_TH = torch.zeros_like(x_TH)
    dx_TH = torch.zeros_like(x_TH)
    d_topk_weights_TK = torch.zeros(topk_idx_TK.shape, dtype=dtype, device=x_TH.device)
    dw13_EFH = torch.zeros(w13_EFH.shape, dtype=dtype, device=x_TH.device)
    dw2_EHI = torch.zeros(w2_EHI.shape, dtype=dtype, device=x_TH.device)
    for e in range(num_experts):
        token_N, slot_N = (topk_idx_TK == e).nonzero(as_tuple=True)
        if token_N.numel() == 0:
            continue
        w13q_FH = quantize_matrix(w13_EFH[e].to(dtype))
        w2q_HI = quantize_matrix(w2_EHI[e].to(dtype))
        w_N = topk_weights_TK[token_N, slot_N].to(dtype)[:, None]
        # forward
        z_NF = xq_TH[token_N] @ w13q_FH.t()
        g_NI, u_NI, _, _ = _clamped(z_NF, intermediate, swiglu_clamp)
        h_NI = _bf16(F.silu(g_NI) * u_NI)
        o_NH = quantize_rows(h_NI) @ w2q_HI.t()
        y_TH.index_add_(0, token_N, _bf16(o_NH * w_N))
        # backward, from the bf16 z the forward saves
        zb_NF = _bf16(z_NF)
        g_NI, u_NI, g_pass_NI, u_pass_NI = _clamped(zb_NF, intermediate, swiglu_clamp)
        a_NI = dyq_TH[token_N] @ w2q_HI
        sig_NI = torch.sigmoid(g_NI)
        silu_NI = g_NI * sig_NI
        hb_NI = _bf16(silu_NI * u_NI)
        d_topk_weights_TK[token_N, slot_N] = (hb_NI * a_NI).sum(dim=1)
        dh_NI = w_N * a_NI
        dz_NF = _bf16(torch.cat([dh_NI * u_NI * sig_NI * (1 + g_NI * (1 - sig_NI)) * g_pass_NI,
                                 dh_NI * silu_NI * u_pass_NI], dim=1))
        dx_TH.index_add_(0, token_N, _bf16(quantize_rows(dz_NF) @ w13q_FH))
        wh_NI = _bf16(w_N * hb_NI)
        if fp8_weight_grads:  # token_N, slot_N: the expert's rows in slot order
            dw2_EHI[e] = (quantize_token_blocks(dy_TH[token_N], False).t()
                          @ quantize_token_blocks(wh_NI, True))
            dw13_EFH[e] = (quantize_token_blocks(dz_NF, False).t()
                           @ quantize_token_blocks(x_TH[token_N], True))
        else:
            dw2_EHI[e] = dy_TH[token_N].t() @ wh_NI
            dw13_EFH[e] = dz_NF.t() @ x_TH[token_N]
    return dict(y=_bf16(y_TH), dx=_bf16(dx_TH), d_topk_weights=d_topk_weights_TK, dw13=dw13_EFH,
                dw2=dw2_EHI)
