"""fusemoe.ExpertParallelMoEExperts: the experts of one MoE layer spread over the R ranks of a
torch.distributed process group (the GPUs of one NVLink node), computed by fusemoe's
expert-parallel layer (include/fusemoe/expert_parallel.h) through the custom ops
fusemoe::ep_moe_experts_forward / fusemoe::ep_moe_experts_backward.

    y_t = sum_j w[t,j] * W2_e (silu(Wg_e x_t) * (Wu_e x_t)),  e = topk_idx[t,j] (GLOBAL ids)

Rank r holds experts [r L, (r+1) L), L = E / R, and passes its own tokens; tokens travel to the
ranks that own their experts and come back combined. Outputs are bitwise those of the single-GPU
op (fusemoe.moe_experts, impl "fused") run on the concatenation of every rank's tokens (rank 0's
first): y, dx and d_topk_weights of this rank's tokens, dw13/dw2 of its experts. The expert weight
gradients therefore already sum over every rank's tokens: keep these Parameters out of any
data-parallel gradient reduction (DDP, FSDP's reduce-scatter) over the same ranks.
Shape legend: T tokens of this rank, H hidden, I expert intermediate, F = 2I, E experts (global),
L = E / R local experts, K top-k.

Collective rules (the layer's ranks wait for each other on the GPU):
- constructing the module is collective over the group: every rank, in the same order;
- every rank makes the same forward and backward calls in the same order (one shared symmetric
  workspace serves every module of the same shape on the group, so the order is across modules
  too), with the same grad mode; a rank whose output does not reach its loss must still run the
  backward;
- a rank that never arrives makes the others fail after FUSEMOE_WAIT_TIMEOUT_S (default 30 s)
  with an error naming the ranks, instead of hanging.
Teardown: a layer keeps no reference to its group, so dist.destroy_process_group() frees it
(call it before the process exits); a layer whose group was destroyed refuses calls, and its
symmetric workspace is given back when the next layer context is built.
Expert ids outside [-1, E) never index memory and are reported without blocking, as by
fusemoe.moe_experts, but the expert-parallel ops never raise a report themselves (a rank that
stopped calling would leave its peers waiting): fusemoe.check_expert_ids() raises it, called where
every rank has finished its calls (e.g. after each optimizer step), or the next single-GPU fusemoe
call on the device does.

Memory: each rank's symmetric workspace (torch.distributed._symmetric_memory, zeroed once) and
private workspaces (torch's caching allocator, per call) are sized for the worst case, every
token of every rank routed to one rank, so nothing is ever dropped; so is the forward's saved
state (R times the single-GPU op's z). docs/expert_parallel.md has the figures.
Blockwise FP8 (precision="fp8", impl "fused" as always here; H and I multiples of 128): tokens
travel in bf16 and each owner quantizes the rows it receives, so outputs are bitwise the single-GPU
op's at precision="fp8" on the concatenated batch. The calls read this rank's FP8 weight buffer
(fusemoe.fp8.quantize_weights_fp8 of its L experts: the library's ep_quantize_weights_fp8 makes
the same bytes), which the module keeps in an Fp8WeightCache and rebuilds once per weight update,
as fusemoe.MoEExperts does. fp8_weight_grads=True is refused: the weight gradients come from bf16
operands (the C++ layer does not support FP8 weight gradients in expert parallelism yet). A bf16 and
an fp8 layer of the same shape hold a symmetric workspace each (their contexts differ).
The ranks' GPUs must reach each other's memory (one node, NVLink or PCIe peer access). Several
ranks on one GPU (testing) work with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 and a gloo
group: the GPU time-slices between the processes, so their timings mean nothing.
"""
import ctypes
import os
import socket
import threading
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _capi, ops
from ._checks import _check_fp8_buffer_bytes, _check_fp8_dims
from .modules import _invalidate_fp8_caches, op_inputs, op_weights, output_like

if dist.is_available() and not dist.is_initialized():
    # torch.distributed.nn's functions take group=group.WORLD as a default argument: imported
    # after init_process_group (torch._dynamo imports it lazily), they keep the default group
    # alive past destroy_process_group into interpreter exit, where gloo's threads can abort the
    # process. Imported now, the defaults are None.
    import torch.distributed.nn  # noqa: F401

API = "fusemoe.ExpertParallelMoEExperts"
WORLD_SIZES = (1, 2, 4, 8)  # fusemoe::EpConfig::world_size
PRECISIONS = ("bf16", "fp8")
FP8_WEIGHTS_MADE_BY = "fusemoe.fp8.quantize_weights_fp8(w13, w2) of this rank's experts"
ALLOW_OVERLAPPING_DEVICES = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"


def _fail(message):
    ops._fail(message, API)


class _EpContext:
    """One rank's expert-parallel layer on a group: the C config, the symmetric workspace (held
    here until the group is destroyed and another context is built) and the host table of the R
    ranks' workspaces as mapped in this process."""

    def __init__(self, group, device, config, symmetric, handle, peers):
        # Weakly: dist.destroy_process_group() must free the group (and join its threads) while
        # the contexts live on; a process exiting with gloo's threads alive can abort.
        self._group = weakref.ref(group)
        self.device = device
        self.config = config
        self.symmetric = symmetric
        self.handle = handle
        self.peer_table = (ctypes.c_void_p * len(peers))(*peers)
        self.peer_table_address = ctypes.addressof(self.peer_table)

    def built_on(self, group):
        return self._group() is group

    def release_if_orphaned(self):
        """Frees the symmetric workspace once the group is gone: no call can use it again
        (_context refuses the context), but a last call's kernels may still be running, so the
        device finishes its work first."""
        if self.symmetric is None or self._group() is not None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.symmetric = self.handle = None

    @property
    def group(self):
        group = self._group()
        if group is None:
            _fail("the process group this expert-parallel layer was built on was destroyed "
                  "(build the module again on a live group)")
        return group


_contexts_lock = threading.Lock()
_contexts = []       # context id -> _EpContext (the ops take the id: an int traces as a constant)
_context_ids = {}    # (group name, device index, layer dims) -> context id


def _context(context_id):
    if not isinstance(context_id, int) or not 0 <= context_id < len(_contexts):
        _fail(f"context {context_id!r} is not an expert-parallel context of this process "
              "(use fusemoe.ExpertParallelMoEExperts)")
    ctx = _contexts[context_id]
    ctx.group  # raises if the group was destroyed: its peers' workspaces may be gone
    return ctx


def check_precision(precision, fp8_weight_grads=False):
    """The module's precision options (no group needed, so the constructor checks them first)."""
    if precision not in PRECISIONS:
        _fail(f"precision must be \"bf16\" or \"fp8\", got {precision!r}")
    if not isinstance(fp8_weight_grads, bool):
        _fail(f"fp8_weight_grads must be a bool, got {fp8_weight_grads!r}")
    if fp8_weight_grads:
        _fail("fp8_weight_grads=True is not supported with expert parallelism yet (its weight "
              "gradients come from bf16 operands at precision=\"fp8\"); pass "
              "fp8_weight_grads=False")


def check_layer(world_size, num_experts, hidden_dim, intermediate_dim, top_k,
                max_tokens_per_rank, precision="bf16", fp8_weight_grads=False):
    """The expert-parallel limits of a layer over world_size ranks, in the module's argument
    names (the library checks the rest, e.g. H % 128, when the context is built)."""
    check_precision(precision, fp8_weight_grads)
    if world_size not in WORLD_SIZES:
        _fail(f"the process group has {world_size} ranks; expert parallelism needs "
              f"{', '.join(map(str, WORLD_SIZES))}")
    for name, value in (("num_experts", num_experts), ("hidden_dim", hidden_dim),
                        ("intermediate_dim", intermediate_dim), ("top_k", top_k),
                        ("max_tokens_per_rank", max_tokens_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            _fail(f"{name} must be a positive int, got {value!r}")
    if num_experts % world_size != 0:
        _fail(f"num_experts ({num_experts}) must be divisible by the group's size ({world_size}): "
              "each rank holds num_experts / world_size experts")
    if top_k > num_experts:
        _fail(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
    if precision == "fp8":
        _check_fp8_dims(num_experts, hidden_dim, intermediate_dim, API)


def _all_gather_object(value, group):
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def _check_ranks_reach_each_other(group, device):
    """Every rank on one host, on GPUs that can map each other's memory; ranks sharing a GPU
    only with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 in each one's environment. Collective;
    every rank decides from what all of them sent, so all raise or none does (a rank that stopped
    here alone would leave the others waiting in the rendezvous)."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    visible = {str(torch.cuda.get_device_properties(i).uuid): i
               for i in range(torch.cuda.device_count())}
    ranks = _all_gather_object(
        dict(host=socket.gethostname(), gpu=uuid, index=device.index,
             allow_overlap=os.environ.get(ALLOW_OVERLAPPING_DEVICES) == "1",
             # Peers this rank's GPU cannot access, among the GPUs this process sees (one it
             # cannot see, under CUDA_VISIBLE_DEVICES, is left to the rendezvous).
             no_access=sorted(other for other, i in visible.items() if other != uuid
                              and not torch.cuda.can_device_access_peer(device.index, i))),
        group)
    hosts = sorted({r["host"] for r in ranks})
    if len(hosts) > 1:
        raise _capi.FusemoeError(
            f"{API}: the group's ranks are on {len(hosts)} hosts ({', '.join(hosts)}); expert "
            "parallelism needs every rank on one node, whose GPUs map each other's memory")
    for r, mine in enumerate(ranks):
        sharing = [q for q, other in enumerate(ranks) if other["gpu"] == mine["gpu"] and q != r]
        if sharing and not mine["allow_overlap"]:
            raise _capi.FusemoeError(
                f"{API}: rank {r} shares its GPU with rank(s) {sharing}; several ranks on one "
                f"GPU (a test setting: the GPU time-slices between them) need "
                f"{ALLOW_OVERLAPPING_DEVICES}=1 in every rank's environment")
        for q, other in enumerate(ranks):
            if other["gpu"] in mine["no_access"]:
                raise _capi.FusemoeError(
                    f"{API}: rank {r}'s GPU (cuda:{mine['index']} there) cannot access the memory "
                    f"of rank {q}'s GPU (cuda:{other['index']} there): expert parallelism needs "
                    "peer access (NVLink or PCIe) between every pair of the group's GPUs")


def _connect(group, device, num_bytes):
    """Collective: num_bytes of symmetric memory on device, zeroed once, mapped by every rank.
    Returns (the tensor, its rendezvous handle, [the R ranks' workspace addresses here])."""
    if device.type != "cuda":
        _fail(f"device must be a CUDA device, got {device}")
    from torch.distributed import _symmetric_memory as symm_mem
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    with torch.cuda.device(device):
        _check_ranks_reach_each_other(group, device)
        symmetric = symm_mem.empty(num_bytes, dtype=torch.uint8, device=device)
        symmetric.zero_()
        torch.cuda.synchronize(device)  # zeroed before any peer can see it
        try:
            handle = symm_mem.rendezvous(symmetric, group)
        except RuntimeError as e:
            raise _capi.FusemoeError(
                f"{API}: symmetric memory rendezvous over the group failed (are the ranks' GPUs "
                f"peers of each other?): {e}") from e
        if handle is None:
            raise _capi.FusemoeError(f"{API}: symmetric memory rendezvous returned no handle")
        # The tensor may lie inside a larger symmetric block (torch's symmetric memory pool):
        # buffer_ptrs name the blocks, so each rank's workspace is its block plus its own offset.
        # Gathering the offsets is also the barrier after which every rank has zeroed its buffer.
        bases = list(handle.buffer_ptrs)
        offset = symmetric.data_ptr() - bases[rank]
        inside = 0 <= offset <= handle.buffer_size - num_bytes
        offsets = _all_gather_object(offset if inside else None, group)
    if None in offsets:
        raise _capi.FusemoeError(
            f"{API}: rank {offsets.index(None)}'s symmetric tensor is not inside the block its "
            f"rendezvous handle names (this rank: tensor {symmetric.data_ptr():#x}, block "
            f"{bases[rank]:#x} + {handle.buffer_size} bytes, {num_bytes} needed)")
    return symmetric, handle, [bases[r] + offsets[r] for r in range(world_size)]


def _ep_context(group, device, hidden, intermediate, num_experts, top_k, max_tokens,
                swiglu_clamp, precision="bf16"):
    """The context id of a layer shape and precision on a group and device: built (collectively)
    by the first module of that shape, shared by the next ones (their calls are ordered on every
    rank)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    check_layer(world_size, num_experts, hidden, intermediate, top_k, max_tokens, precision)
    key = (group.group_name, device.type, device.index, hidden, intermediate, num_experts, top_k,
           max_tokens, swiglu_clamp, precision)
    with _contexts_lock:
        context_id = _context_ids.get(key)
        # A group destroyed and initialized again may reuse the name: a new context then.
        if context_id is not None and _contexts[context_id].built_on(group):
            return context_id
        # Contexts of destroyed groups give their workspaces back before this one is allocated
        # (a group initialized again would otherwise hold two).
        for ctx in _contexts:
            ctx.release_if_orphaned()
        config = _capi.ep_config(hidden, intermediate, num_experts, top_k, max_tokens,
                                 world_size, rank, swiglu_clamp, precision)
        symmetric, handle, peers = _connect(group, device, config.symmetric_bytes)
        _contexts.append(_EpContext(group, device, config, symmetric, handle, peers))
        _context_ids[key] = len(_contexts) - 1
        return len(_contexts) - 1


# ---- the ops ----

def _check_call(context_id, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dy_TH=None,
                fp8_weights=None):
    """The op's tensors against its context (fp8_weights: this rank's FP8 weight buffer at
    precision "fp8", None at "bf16"); returns (context, T)."""
    ctx = _context(context_id)
    c = ctx.config
    hidden, intermediate, local_experts, top_k, num_tokens = ops._check_inputs(
        x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dy_TH, api=API)
    expected = (c.hidden, c.intermediate, c.num_experts // c.world_size, c.top_k)
    if (hidden, intermediate, local_experts, top_k) != expected:
        _fail(f"(H, I, local experts, K) of the call are "
              f"{(hidden, intermediate, local_experts, top_k)}, the module's are {expected}")
    if num_tokens > c.max_tokens:
        _fail(f"this rank passes {num_tokens} tokens, more than max_tokens_per_rank = "
              f"{c.max_tokens} (the symmetric workspace's size)")
    if x_TH.device != ctx.device:
        _fail(f"tensors are on {x_TH.device}, the module's workspace on {ctx.device}")
    if c.precision == "fp8":
        if fp8_weights is None:
            _fail(f"precision=\"fp8\" needs fp8_weights, the buffer of {FP8_WEIGHTS_MADE_BY}")
        _check_fp8_buffer_bytes(fp8_weights, (local_experts, hidden, intermediate), x_TH.device, c,
                                FP8_WEIGHTS_MADE_BY, API)
    elif fp8_weights is not None:
        _fail(f"fp8_weights must be None at precision={c.precision!r} (only an \"fp8\" layer "
              "reads an FP8 weight buffer)")
    return ctx, num_tokens


def _weight_pointers(ctx, w13_LFH, w2_LHI, fp8_weights):
    """(w13, w2, fp8_weights) as the C call takes them: at precision "fp8" the buffer, and null
    bf16 weights (the library does not read them), as the single-GPU FP8 op passes them."""
    if ctx.config.precision == "fp8":
        return None, None, fp8_weights.data_ptr()
    return w13_LFH.data_ptr(), w2_LHI.data_ptr(), None


def _empty_saved_state(x_TH, ctx, save_z):
    return x_TH.new_empty(ctx.config.saved_state_bytes if save_z else 0, dtype=torch.uint8)


@torch.library.custom_op("fusemoe::ep_moe_experts_forward", mutates_args=())
def ep_moe_experts_forward(x_TH: Tensor, topk_idx_TK: Tensor, topk_weights_TK: Tensor,
                           w13_LFH: Tensor, w2_LHI: Tensor, context: int,
                           save_z: bool, grad_in_place: bool = False,
                           fp8_weights: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Returns (y [T, H] bf16, saved state): the saved state is what the backward of the same
    inputs reads instead of recomputing z (uint8, opaque), or empty when not save_z.
    grad_in_place: read by the backward only (fusemoe.moe_experts' grad_in_place). fp8_weights:
    this rank's FP8 weight buffer when the context's precision is "fp8" (gets no gradient; w13
    and w2 then give the shapes only), else None."""
    ctx, num_tokens = _check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI,
                                  fp8_weights=fp8_weights)
    ops._check_cuda(x_TH, API)
    y_TH = torch.empty_like(x_TH)
    saved = _empty_saved_state(x_TH, ctx, save_z)
    c = ctx.config
    with torch.cuda.device(x_TH.device):
        report = ops._expert_id_report(x_TH.device, c.num_experts, c.top_k, raise_pending=False)
        workspace, num_bytes = ops._workspace(c, x_TH.device, "forward")
        w13, w2, fp8 = _weight_pointers(ctx, w13_LFH, w2_LHI, fp8_weights)
        _capi.ep_forward(c, x_TH.data_ptr(), topk_idx_TK.data_ptr(), topk_weights_TK.data_ptr(),
                         w13, w2, y_TH.data_ptr(), num_tokens, ctx.peer_table_address,
                         workspace.data_ptr(), num_bytes, report,
                         saved.data_ptr() if save_z else None,
                         torch.cuda.current_stream(x_TH.device).cuda_stream, fp8_weights=fp8)
    return y_TH, saved


@ep_moe_experts_forward.register_fake
def _ep_forward_fake(x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context, save_z,
                     grad_in_place=False, fp8_weights=None):
    ctx, _ = _check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI,
                         fp8_weights=fp8_weights)
    return torch.empty_like(x_TH), _empty_saved_state(x_TH, ctx, save_z)


def _check_saved_state(ctx, saved_state, x_TH):
    """None, or a forward's non-empty saved state for this context."""
    if saved_state is None or saved_state.numel() == 0:
        return None
    expected = ctx.config.saved_state_bytes
    if (saved_state.dtype != torch.uint8 or tuple(saved_state.shape) != (expected,)
            or saved_state.device != x_TH.device):
        _fail(f"saved_state must be the forward's: uint8 [{expected}] on {x_TH.device}, got "
              f"{saved_state.dtype} {tuple(saved_state.shape)} on {saved_state.device}")
    return saved_state


@torch.library.custom_op("fusemoe::ep_moe_experts_backward", mutates_args=())
def ep_moe_experts_backward(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                            topk_weights_TK: Tensor, w13_LFH: Tensor, w2_LHI: Tensor,
                            context: int, saved_state: Optional[Tensor] = None,
                            gate_up_grad: bool = True, down_grad: bool = True,
                            fp8_weights: Optional[Tensor] = None
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (dx [T, H] bf16, d_topk_weights [T, K] fp32, dw13 [L, F, H], dw2 [L, H, I]) in
    the weights' dtype; saved_state: the forward's (skips recomputing z), or None.
    gate_up_grad / down_grad as fusemoe::moe_experts_backward's (frozen weights: 0-element).
    fp8_weights: as ep_moe_experts_forward's."""
    weights = (w13_LFH, w2_LHI)
    grads = ops._fresh_weight_grads(weights, gate_up_grad, down_grad)
    dx_TH, d_topk_weights_TK = _ep_backward_call(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH,
                                                 w2_LHI, *grads, False, context, saved_state,
                                                 fp8_weights)
    return (dx_TH, d_topk_weights_TK, *ops._returned_weight_grads(grads, weights))


def _ep_backward_call(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dw13_LFH,
                      dw2_LHI, accumulate, context, saved_state, fp8_weights):
    """The C ABI's EP backward into dw13/dw2 (overwritten, or added to with accumulate; None:
    not computed); returns (dx, d_topk_weights)."""
    ctx, num_tokens = _check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI,
                                  dy_TH, fp8_weights)
    ops._check_cuda(x_TH, API)
    saved_state = _check_saved_state(ctx, saved_state, x_TH)
    dx_TH, d_topk_weights_TK = torch.empty_like(x_TH), torch.empty_like(topk_weights_TK)
    # A frozen weight stands in for its gradient: the checks are those of a call with both.
    grad_dtype = ops._check_weight_grads(w13_LFH if dw13_LFH is None else dw13_LFH,
                                         w2_LHI if dw2_LHI is None else dw2_LHI, w13_LFH, w2_LHI,
                                         API)
    c = ctx.config
    with torch.cuda.device(x_TH.device):
        report = ops._expert_id_report(x_TH.device, c.num_experts, c.top_k, raise_pending=False)
        use = "backward" if saved_state is None else "backward_saved_z"
        workspace, num_bytes = ops._workspace(c, x_TH.device, use)
        w13, w2, fp8 = _weight_pointers(ctx, w13_LFH, w2_LHI, fp8_weights)
        _capi.ep_backward(c, x_TH.data_ptr(), topk_idx_TK.data_ptr(), topk_weights_TK.data_ptr(),
                          w13, w2, dy_TH.data_ptr(),
                          dx_TH.data_ptr(), d_topk_weights_TK.data_ptr(), ops._pointer(dw13_LFH),
                          ops._pointer(dw2_LHI), grad_dtype, bool(accumulate), num_tokens,
                          ctx.peer_table_address, workspace.data_ptr(), num_bytes, report,
                          saved_state.data_ptr() if saved_state is not None else None,
                          torch.cuda.current_stream(x_TH.device).cuda_stream, fp8_weights=fp8)
    return dx_TH, d_topk_weights_TK


@ep_moe_experts_backward.register_fake
def _ep_backward_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context,
                      saved_state=None, gate_up_grad=True, down_grad=True, fp8_weights=None):
    ctx, _ = _check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dy_TH,
                         fp8_weights)
    _check_saved_state(ctx, saved_state, x_TH)
    weights = (w13_LFH, w2_LHI)
    return (torch.empty_like(x_TH), torch.empty_like(topk_weights_TK),
            *ops._returned_weight_grads(ops._fresh_weight_grads(weights, gate_up_grad, down_grad),
                                        weights))


@torch.library.custom_op("fusemoe::ep_moe_experts_backward_into", mutates_args=("dw13_LFH", "dw2_LHI"))
def ep_moe_experts_backward_into(dy_TH: Tensor, x_TH: Tensor, topk_idx_TK: Tensor,
                                 topk_weights_TK: Tensor, w13_LFH: Tensor, w2_LHI: Tensor,
                                 dw13_LFH: Tensor, dw2_LHI: Tensor, accumulate: bool, context: int,
                                 saved_state: Optional[Tensor] = None,
                                 fp8_weights: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """ep_moe_experts_backward with the weight gradients written into dw13/dw2 (the weights'
    shapes; bf16 or fp32), added to what they hold when accumulate. Returns (dx, d_topk_weights)."""
    return _ep_backward_call(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dw13_LFH,
                             dw2_LHI, accumulate, context, saved_state, fp8_weights)


@ep_moe_experts_backward_into.register_fake
def _ep_backward_into_fake(dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dw13_LFH,
                           dw2_LHI, accumulate, context, saved_state=None, fp8_weights=None):
    ctx, _ = _check_call(context, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dy_TH,
                         fp8_weights)
    _check_saved_state(ctx, saved_state, x_TH)
    ops._check_weight_grads(dw13_LFH, dw2_LHI, w13_LFH, w2_LHI, API)
    return torch.empty_like(x_TH), torch.empty_like(topk_weights_TK)


def _setup_context(ctx, inputs, output):
    x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context, _, grad_in_place, fp8_weights = \
        inputs
    saved = output[1]
    ctx.mark_non_differentiable(saved)
    ctx.set_materialize_grads(False)  # no zero-filled gradient of the saved state
    ctx.save_for_backward(x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, saved, fp8_weights)
    ctx.context = context
    ctx.num_weights = 2
    # In-place gradients need the leaf Parameters themselves (as fusemoe.moe_experts).
    ctx.params = ((w13_LFH, w2_LHI) if grad_in_place and w13_LFH.is_leaf and w2_LHI.is_leaf and
                  w13_LFH.requires_grad and w2_LHI.requires_grad else None)
    ctx.weights_need_grad = (w13_LFH.requires_grad, w2_LHI.requires_grad)  # as ops


def _backward(ctx, dy_TH, _saved_grad_unused):
    x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, saved, fp8_weights = ctx.saved_tensors
    # Every rank must take part in the backward, so a missing gradient is a zero one.
    dy_TH = torch.zeros_like(x_TH) if dy_TH is None else dy_TH.contiguous()
    saved_state = saved if saved.numel() else None
    ops._refuse_create_graph()
    if ops._in_place_path(ctx):
        dx_TH, d_topk_weights_TK = ops._backward_into_grads(
            ctx, lambda dw13, dw2, accumulate: ep_moe_experts_backward_into(
                dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, dw13, dw2, accumulate,
                ctx.context, saved_state, fp8_weights))
        dw13_LFH = dw2_LHI = None
    else:
        # Frozen weights' gradients are not computed (every rank asks the same: weights are
        # frozen on all ranks or none, as the model's parameters are).
        need_dw13, need_dw2 = ctx.weights_need_grad
        dx_TH, d_topk_weights_TK, dw13_LFH, dw2_LHI = ep_moe_experts_backward(
            dy_TH, x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, ctx.context, saved_state,
            need_dw13, need_dw2, fp8_weights)
        dw13_LFH, dw2_LHI = (dw13_LFH if need_dw13 else None), (dw2_LHI if need_dw2 else None)
    return dx_TH, None, d_topk_weights_TK, dw13_LFH, dw2_LHI, None, None, None, None


ep_moe_experts_forward.register_autograd(_backward, setup_context=_setup_context)


def ep_moe_experts(x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context,
                   recompute_z=False, grad_in_place=False, fp8_weights=None):
    """The expert-parallel experts block as a differentiable function of this rank's tokens and
    experts (strict inputs as fusemoe.moe_experts; context: ExpertParallelMoEExperts.context).
    recompute_z: as fusemoe.moe_experts (the saved state is sized for the worst case: R times
    the single-GPU op's z). grad_in_place: as fusemoe.moe_experts (leaf w13/w2: the backward
    kernels write or add this rank's weight gradients straight into their .grad; eager only).
    fp8_weights (a context of precision "fp8"): the buffer of
    fusemoe.fp8.quantize_weights_fp8(w13, w2), or None for the one cached on w13 (rebuilt when
    w13 or w2 change), as fusemoe.moe_experts at precision="fp8"."""
    if fp8_weights is None and _context(context).config.precision == "fp8":
        from .fp8 import cached_fp8_weights
        fp8_weights = cached_fp8_weights(w13_LFH, w2_LHI)
    save_z = ops._wants_saved_z("fused", recompute_z, x_TH, topk_weights_TK, w13_LFH, w2_LHI)
    return ep_moe_experts_forward(x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, context,
                                  save_z, bool(grad_in_place), fp8_weights)[0]


def local_device():
    """This process's GPU under torchrun (LOCAL_RANK, LOCAL_WORLD_SIZE): GPU LOCAL_RANK when the
    node shows at least as many GPUs as it runs ranks, else GPU 0 for every rank (a one-GPU test
    setting), for which it sets TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (read by the
    symmetric-memory rendezvous, so call it before the first module). Returns (device, whether
    the ranks share GPU 0); also makes the device current."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    shared = torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = torch.device("cuda", 0 if shared else local_rank)
    torch.cuda.set_device(device)
    if shared:
        os.environ[ALLOW_OVERLAPPING_DEVICES] = "1"
    return device, shared


# ---- the module ----

class ExpertParallelMoEExperts(nn.Module):
    """This rank's share of an MoE layer's experts (gate_up_proj [L, 2I, H], down_proj
    [L, H, I], L = E / R: global experts [rank L, (rank + 1) L)) over a process group, with
    MoEExperts.forward's signature: forward(hidden_states, top_k_index, top_k_weights) with
    GLOBAL expert ids. See the module docstring for the collective rules."""

    def __init__(self, num_experts, hidden_dim, intermediate_dim, top_k, max_tokens_per_rank,
                 group=None, device=None, dtype=torch.bfloat16, init_std=0.02,
                 recompute_z=False, swiglu_clamp=None, grad_in_place=False, precision="bf16",
                 fp8_weight_grads=False):
        """num_experts: E of the whole layer. top_k and max_tokens_per_rank (the largest T any
        rank passes) size the symmetric workspace, so they are fixed here. group: a
        torch.distributed process group (None: the default group); its size is R. device: this
        rank's GPU (None: the current CUDA device). grad_in_place: as fusemoe.MoEExperts (the
        backward adds this rank's weight gradients straight into .grad; eager mode, bf16
        parameters, no gradient hooks on them). precision: "bf16", or "fp8" (blockwise FP8
        GEMMs on the owner ranks, hidden_dim and intermediate_dim multiples of 128; this rank's
        FP8 weights rebuilt once per weight update, as fusemoe.MoEExperts'). fp8_weight_grads:
        False only (FP8 weight gradients are not supported in expert parallelism yet).
        Collective over the group."""
        super().__init__()
        check_precision(precision, fp8_weight_grads)
        if not dist.is_available() or not dist.is_initialized():
            _fail("torch.distributed is not initialized (call init_process_group first)")
        group = dist.group.WORLD if group is None else group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        check_layer(world_size, num_experts, hidden_dim, intermediate_dim, top_k,
                    max_tokens_per_rank, precision, fp8_weight_grads)
        if isinstance(swiglu_clamp, bool):  # float(True) would be a clamp of 1.0
            _fail(f"swiglu_clamp must be None or a number, got {swiglu_clamp!r}")
        device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.num_experts, self.hidden_dim, self.intermediate_dim = (num_experts, hidden_dim,
                                                                    intermediate_dim)
        self.top_k, self.max_tokens_per_rank = top_k, max_tokens_per_rank
        self.world_size, self.rank = world_size, rank
        self.num_local_experts = num_experts // world_size
        self.recompute_z = bool(recompute_z)
        self.grad_in_place = bool(grad_in_place)
        self.swiglu_clamp = None if swiglu_clamp is None else float(swiglu_clamp)
        self.init_std = init_std
        self.precision = precision
        from .fp8 import Fp8WeightCache
        self._fp8_cache = Fp8WeightCache()  # empty until a forward at precision "fp8"
        self.context = _ep_context(group, device, hidden_dim, intermediate_dim, num_experts,
                                   top_k, max_tokens_per_rank, self.swiglu_clamp, precision)
        self.gate_up_proj = nn.Parameter(torch.empty(
            self.num_local_experts, 2 * intermediate_dim, hidden_dim, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(
            self.num_local_experts, hidden_dim, intermediate_dim, device=device, dtype=dtype))
        self.reset_parameters()
        # A load must reach the FP8 cache even where it keeps the weights' versions (fusemoe.fp8).
        self.register_load_state_dict_post_hook(_invalidate_fp8_caches)

    @property
    def first_expert(self):
        """The global id of this rank's first expert."""
        return self.rank * self.num_local_experts

    def reset_parameters(self):
        # Hugging Face's Qwen3-MoE initialisation, drawn by each rank for its own experts.
        nn.init.normal_(self.gate_up_proj, std=self.init_std)
        nn.init.normal_(self.down_proj, std=self.init_std)
        if self._fp8_cache.quantizations:  # new values, perhaps the same versions
            _invalidate_fp8_caches(self, None)

    @classmethod
    def from_experts(cls, experts, max_tokens_per_rank, top_k=None, group=None,
                     recompute_z=False, swiglu_clamp=None, grad_in_place=False, precision="bf16",
                     fp8_weight_grads=False):
        """This rank's share of a whole experts module (a transformers experts module or a
        fusemoe.MoEExperts, gate_up_proj [E, 2I, H], down_proj [E, H, I]): its experts' weights
        copied into new Parameters on the module's device and dtype. Build it on every rank from
        the same weights (e.g. the same seed) and the ranks hold exactly that layer. top_k: None
        takes experts.config.num_experts_per_tok (transformers). Collective over the group."""
        if top_k is None:
            top_k = getattr(getattr(experts, "config", None), "num_experts_per_tok", None)
            if top_k is None:
                _fail("top_k is needed (the experts module has no config.num_experts_per_tok)")
        w13_EFH, w2_EHI = experts.gate_up_proj, experts.down_proj
        num_experts, two_intermediate, hidden_dim = w13_EFH.shape
        module = cls(num_experts, hidden_dim, two_intermediate // 2, top_k, max_tokens_per_rank,
                     group=group, device=w13_EFH.device, dtype=w13_EFH.dtype,
                     recompute_z=recompute_z, swiglu_clamp=swiglu_clamp,
                     grad_in_place=grad_in_place, precision=precision,
                     fp8_weight_grads=fp8_weight_grads)
        first, count = module.first_expert, module.num_local_experts
        with torch.no_grad():
            module.gate_up_proj.copy_(w13_EFH[first:first + count])
            module.down_proj.copy_(w2_EHI[first:first + count])
        return module

    def forward(self, hidden_states, top_k_index, top_k_weights):
        """hidden_states [..., H] (this rank's tokens), top_k_index [..., K] (GLOBAL expert ids;
        -1 masks a slot), top_k_weights [..., K] -> [..., H] in hidden_states' dtype."""
        w13_LFH, w2_LHI = op_weights(self.gate_up_proj, self.down_proj)
        x_TH, topk_idx_TK, topk_weights_TK = op_inputs(hidden_states, top_k_index, top_k_weights,
                                                       self.hidden_dim)
        fp8_weights = None
        if self.precision == "fp8":
            from .fp8 import cached_fp8_weights
            # Keyed on the Parameters themselves (an fp32 master's bf16 copy is new each call).
            fp8_weights = cached_fp8_weights(w13_LFH, w2_LHI, self._fp8_cache,
                                             (self.gate_up_proj, self.down_proj))
        y_TH = ep_moe_experts(x_TH, topk_idx_TK, topk_weights_TK, w13_LFH, w2_LHI, self.context,
                              self.recompute_z, self.grad_in_place, fp8_weights)
        return output_like(y_TH, hidden_states)

    def extra_repr(self):
        return (f"num_experts={self.num_experts} (experts {self.first_expert}.."
                f"{self.first_expert + self.num_local_experts - 1} on rank {self.rank} of "
                f"{self.world_size}), hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, top_k={self.top_k}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}" +
                (", recompute_z=True" if self.recompute_z else "") +
                (", grad_in_place=True" if self.grad_in_place else "") +
                (f", swiglu_clamp={self.swiglu_clamp}" if self.swiglu_clamp is not None else "") +
                (f", precision={self.precision!r}" if self.precision != "bf16" else ""))
