"""fusemoe inside a Hugging Face transformers Qwen3-MoE model (tiny config built from
Qwen3MoeConfig; skipped where transformers is not installed).

CPU: replace_qwen3_moe_experts swaps every experts module and keeps the very Parameter objects,
and (over the CPU stand-in kernels of moe_reference.py) the swapped model computes the same
logits and gradients. GPU: fusemoe experts against the model's own experts ("grouped_mm"), with
the model's per-expert loop ("eager") as the measure of bf16 noise (FlashAttention-3 rule).
Numeric comparisons use one MoE layer, the first: its routing sees identical inputs in every
model, so no top-k choice can flip between the models being compared."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fusemoe  # noqa: E402
from conftest import require_gpu  # noqa: E402
from moe_reference import assert_within_noise, register_cpu_kernels, rel_err  # noqa: E402

register_cpu_kernels()

VOCAB, HIDDEN, MOE_INTERMEDIATE, EXPERTS, TOP_K = 256, 256, 128, 8, 4
BF16_NOISE_ATOL = 5e-3  # relative L2; also covers tensors where the two HF paths agree exactly


def tiny_model(num_layers, mlp_only_layers, experts_implementation, device):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512,
        moe_intermediate_size=MOE_INTERMEDIATE, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=512,
        mlp_only_layers=list(mlp_only_layers), attn_implementation="sdpa",
        experts_implementation=experts_implementation)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def set_experts_implementation(model, name):
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    else:
        model.config._experts_implementation = name


def logits_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def test_replace_keeps_parameters():
    model = tiny_model(2, (), "eager", "cpu")
    before = {name: p for name, p in model.named_parameters()}
    replaced = fusemoe.replace_qwen3_moe_experts(model)
    assert replaced == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for layer in model.model.layers:
        assert isinstance(layer.mlp.experts, fusemoe.MoEExperts)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    with pytest.raises(ValueError, match="has no Qwen3MoeExperts"):
        fusemoe.replace_qwen3_moe_experts(model)


def test_swapped_model_matches_cpu():
    reference = tiny_model(2, (1,), "eager", "cpu")
    swapped = copy.deepcopy(reference)
    fusemoe.replace_qwen3_moe_experts(swapped)
    input_ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = logits_and_grads(reference, input_ids)
    got_logits, got_grads = logits_and_grads(swapped, input_ids)
    assert got_grads.keys() == ref_grads.keys()
    assert rel_err(got_logits, ref_logits) <= 2e-2
    for name in ref_grads:  # the CPU stand-in computes in fp32, HF's loop in bf16
        assert rel_err(got_grads[name], ref_grads[name]) <= 5e-2, name


def test_swapped_model_matches_gpu():
    require_gpu()
    reference = tiny_model(2, (1,), "grouped_mm", "cuda")
    noise = copy.deepcopy(reference)
    set_experts_implementation(noise, "eager")
    swapped = copy.deepcopy(reference)
    fusemoe.replace_qwen3_moe_experts(swapped)
    input_ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.cuda()
    ref_logits, ref_grads = logits_and_grads(reference, input_ids)
    noise_logits, noise_grads = logits_and_grads(noise, input_ids)
    got_logits, got_grads = logits_and_grads(swapped, input_ids)
    assert got_grads.keys() == ref_grads.keys()
    rows = [("logits", got_logits, noise_logits, ref_logits)]
    rows += [(n, got_grads[n], noise_grads[n], ref_grads[n]) for n in ref_grads]
    assert_within_noise(rows, BF16_NOISE_ATOL, "eager")
