"""fusemoe.patch_hf_experts over the Hugging Face transformers families whose experts are
fusemoe's math (Qwen3-MoE, Qwen3-Next, OLMoE, Mixtral, Qwen2-MoE, DeepSeek-V4 with its clamp)
and one that is not (gpt-oss). Skipped where transformers is not installed.

CPU: which modules are swapped or left and why, on the real models' dimensions (meta device,
nothing allocated; the library's own limits decide when it is built); on tiny configs, the swap
keeps the Parameter objects and (over the CPU stand-in kernels of moe_reference.py) the swapped
model's loss and gradients equal the original's. GPU: the same tiny models on an sm_90 GPU,
loss, logits and every gradient against the unswapped model ("grouped_mm" experts), with the
model's per-expert loop ("eager") as the measure of bf16 noise (FlashAttention-3 rule). One
decoder layer each, so the router sees identical inputs in every model and no top-k choice can
flip between the models compared.
"""
import copy
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import fusemoe  # noqa: E402
from conftest import require_gpu  # noqa: E402
from moe_reference import (OUTPUTS, assert_within_noise, make_problem,  # noqa: E402
                           register_cpu_kernels, rel_err)

register_cpu_kernels()

BF16_NOISE_ATOL = 5e-3  # relative L2; also covers tensors where the two HF paths agree exactly
VOCAB = 256
_COMMON = dict(vocab_size=VOCAB, num_hidden_layers=1, max_position_embeddings=512)
# family: (config class, tiny config for the numeric tests). H multiple of 128, I of 64.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=True)),
    "qwen3_next": ("Qwen3NextConfig", dict(  # E = 512, K = 10 as Qwen3-Next-80B-A3B
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
        head_dim=64, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=512, num_experts_per_tok=10,
        layer_types=["full_attention"])),
    "olmoe": ("OlmoeConfig", dict(
        hidden_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        shared_expert_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=4)),
}
SWAPPED_CLASS = {"qwen3_moe": "Qwen3MoeExperts", "qwen3_next": "Qwen3NextExperts",
                 "olmoe": "OlmoeExperts", "mixtral": "MixtralExperts",
                 "qwen2_moe": "Qwen2MoeExperts", "deepseek_v4": "DeepseekV4Experts"}


def config_class(name):
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"skipped: transformers {transformers.__version__} has no {name}")
    return cls


def tiny_model(family, experts_implementation, device, dtype=torch.bfloat16):
    config_name, kwargs = FAMILIES[family]
    config = config_class(config_name)(**_COMMON, **kwargs, attn_implementation="sdpa",
                                       experts_implementation=experts_implementation)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(device=device, dtype=dtype)


def real_dims_model(config_name, **overrides):
    """The family's default config (its flagship model's dimensions), two layers, on the meta
    device: planning reads shapes and attributes only."""
    config = config_class(config_name)(num_hidden_layers=2, **overrides)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def require_library():
    if not fusemoe.is_available():
        pytest.skip(f"skipped: libfusemoe_c.so not built (looked at {fusemoe.library_path()})")


def loss_logits_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


# ---- selection on the real dimensions (no memory: meta device) ----

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plan_swaps_every_experts_module_at_real_dims(family):
    model = real_dims_model(FAMILIES[family][0])
    report = fusemoe.plan_hf_experts(model)
    assert report.replaced == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], \
        str(report)
    assert report.left == {}
    assert {d.class_name for d in report.decisions} == {SWAPPED_CLASS[family]}
    assert all(d.swiglu_clamp is None for d in report.decisions)


def test_plan_qwen3_next_has_its_512_experts_top_10():
    model = real_dims_model("Qwen3NextConfig")
    experts = model.get_submodule(fusemoe.plan_hf_experts(model).replaced[0])
    assert experts.gate_up_proj.shape[0] == 512 and experts.config.num_experts_per_tok == 10


def test_plan_deepseek_v4_swaps_with_its_swiglu_limit():
    model = real_dims_model("DeepseekV4Config", swiglu_limit=7.5)
    report = fusemoe.plan_hf_experts(model)
    assert len(report.replaced) == 2 and report.left == {}, str(report)
    assert {d.swiglu_clamp for d in report.decisions} == {7.5}


def test_plan_leaves_gpt_oss_alone_with_each_reason():
    model = real_dims_model("GptOssConfig")
    report = fusemoe.plan_hf_experts(model)
    assert report.replaced == []
    assert sorted(report.left) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    reasons = report.left["model.layers.0.mlp.experts"]
    for expected in ("has biases (gate_up_proj_bias, down_proj_bias)",
                     "weights stored transposed", "gate and up rows interleaved",
                     "its own gate function GptOssExperts._apply_gate"):
        assert expected in reasons, reasons


def test_plan_reads_gpt_oss_limit_through_its_transposed_layout():
    """The library's own limit on gpt-oss, its H read through the transposed layout."""
    require_library()
    reasons = fusemoe.plan_hf_experts(real_dims_model("GptOssConfig")).left[
        "model.layers.0.mlp.experts"]
    assert "hidden (H) must be a positive multiple of 128, got 2880" in reasons, reasons


def test_plan_names_the_library_limit():
    require_library()
    model = real_dims_model("MixtralConfig", hidden_size=4000)  # not a multiple of 128
    report = fusemoe.plan_hf_experts(model)
    assert report.replaced == []
    assert "the library refuses H=4000" in report.left["model.layers.0.mlp.experts"]
    assert "hidden (H) must be a positive multiple of 128, got 4000" in str(report)


def test_plan_checks_impl_and_precision_with_the_library():
    """precision="fp8" runs on impl "fused" only, and needs I a multiple of 128: the plan asks
    the library about the layer with its impl and precision, so it swaps nothing that would fail
    at the first forward."""
    require_library()
    model = real_dims_model("MixtralConfig")
    report = fusemoe.plan_hf_experts(model, impl="unfused", precision="fp8")
    assert report.replaced == [], str(report)
    assert "supported by Impl::kFused only" in report.left["model.layers.0.mlp.experts"]
    assert fusemoe.plan_hf_experts(model, impl="fused", precision="fp8").left == {}
    narrow = real_dims_model("MixtralConfig", intermediate_size=192)
    assert "multiple of 128, got 192" in str(fusemoe.plan_hf_experts(narrow, precision="fp8"))
    assert fusemoe.plan_hf_experts(narrow).left == {}  # bf16 takes I = 192


def test_plan_refuses_another_activation():
    model = real_dims_model("MixtralConfig", hidden_act="gelu")
    assert fusemoe.plan_hf_experts(model).left["model.layers.0.mlp.experts"] == \
        "activation gelu is not SiLU"


# ---- the swap itself on tiny models (CPU stand-in kernels) ----

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patch_keeps_parameters_and_matches_cpu(family):
    reference = tiny_model(family, "eager", "cpu")
    swapped = copy.deepcopy(reference)
    before = dict(swapped.named_parameters())
    report = fusemoe.patch_hf_experts(swapped)
    assert report.replaced == ["model.layers.0.mlp.experts"] and report.left == {}
    assert isinstance(swapped.get_submodule(report.replaced[0]), fusemoe.MoEExperts)
    after = dict(swapped.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    input_ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    ref_loss, ref_logits, ref_grads = loss_logits_grads(reference, input_ids)
    loss, logits, grads = loss_logits_grads(swapped, input_ids)
    assert math.isfinite(loss.item()) and abs(loss.item() - ref_loss.item()) <= 1e-2 * ref_loss.item()
    assert rel_err(logits, ref_logits) <= 2e-2
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:  # the CPU stand-in computes in fp32, HF's loop in bf16
        assert rel_err(grads[name], ref_grads[name]) <= 5e-2, name
    with pytest.raises(ValueError, match="(?s)no experts module swapped.*already a fusemoe.MoEExperts"):
        fusemoe.patch_hf_experts(swapped)  # nothing left to swap


def test_patch_gpt_oss_raises_with_the_reasons_and_changes_nothing():
    config = config_class("GptOssConfig")(**_COMMON, hidden_size=192, intermediate_size=192,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=64, num_local_experts=4, num_experts_per_tok=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = model.model.layers[0].mlp.experts
    with pytest.raises(ValueError, match=r"(?s)no experts module swapped\n.*left    model.layers.0"
                                         r".mlp.experts \(GptOssExperts\): has biases"):
        fusemoe.patch_hf_experts(model)
    report = fusemoe.patch_hf_experts(model, strict=False)
    assert report.replaced == [] and model.model.layers[0].mlp.experts is experts


def test_patch_model_without_experts_raises():
    with pytest.raises(ValueError, match="no experts module found"):
        fusemoe.patch_hf_experts(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_report_lists_swapped_and_left():
    model = real_dims_model("Qwen3MoeConfig")
    model.model.layers[1].mlp.experts.has_bias = True  # as if a bias variant
    report = fusemoe.patch_hf_experts(model)
    assert report.replaced == ["model.layers.0.mlp.experts"]
    assert report.left == {"model.layers.1.mlp.experts": "has biases"}
    text = str(report)
    assert "1 experts module(s) swapped, 1 left alone" in text
    assert "left    model.layers.1.mlp.experts (Qwen3MoeExperts): has biases" in text


# ---- GPU: loss and gradients against the unswapped model ----

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_patched_model_matches_gpu(family):
    require_gpu()
    # The FA3 rule: fusemoe's error against an fp32 run of the same weights is at most twice the
    # error of transformers' own bf16 path (grouped_mm) plus a small absolute term. (Measured
    # against the bf16 grouped_mm run with the bf16 eager run as noise, a tensor where the two
    # HF paths agree exactly gave a bound of the atol alone.)
    noise = tiny_model(family, "grouped_mm", "cuda")
    reference = tiny_model(family, "eager", "cuda", dtype=torch.float32)
    reference.load_state_dict({k: v.float() for k, v in noise.state_dict().items()})
    swapped = copy.deepcopy(noise)
    assert fusemoe.patch_hf_experts(swapped).replaced == ["model.layers.0.mlp.experts"]
    input_ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(1))
    input_ids = input_ids.cuda()
    ref = loss_logits_grads(reference, input_ids)
    base = loss_logits_grads(noise, input_ids)
    got = loss_logits_grads(swapped, input_ids)
    assert got[2].keys() == ref[2].keys()
    rows = [("loss", got[0], base[0], ref[0]), ("logits", got[1], base[1], ref[1])]
    rows += [(n, got[2][n], base[2][n], ref[2][n]) for n in ref[2]]
    assert_within_noise(rows, BF16_NOISE_ATOL, "grouped_mm", prefix=f"{family} ")


def deepseek_v4_experts_outputs(device):
    """y and the gradients of x, topk_weights, gate_up_proj, down_proj of DeepSeek-V4's experts
    module (SwiGLU with swiglu_limit 0.75: active on about a third of g and u here): fp32 HF
    loop ("ref"), bf16 HF loop ("noise"), and the module swapped by patch_hf_experts ("got")."""
    config = config_class("DeepseekV4Config")(hidden_size=256, intermediate_size=128,
                                              num_local_experts=8, num_experts_per_tok=2,
                                              swiglu_limit=0.75)
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    p = make_problem(199, 256, 128, 8, 2, device, seed=31)
    holder = torch.nn.Module()
    holder.experts = DeepseekV4Experts(config).to(device)
    with torch.no_grad():
        holder.experts.gate_up_proj.copy_(p["w13_EFH"].float())
        holder.experts.down_proj.copy_(p["w2_EHI"].float())
    swapped = copy.deepcopy(holder).to(torch.bfloat16)
    report = fusemoe.patch_hf_experts(swapped)
    assert report.decisions[0].swiglu_clamp == 0.75, str(report)
    outs = {}
    for name, model, dtype in (("ref", copy.deepcopy(holder), torch.float32),
                               ("noise", copy.deepcopy(holder).to(torch.bfloat16), torch.bfloat16),
                               ("got", swapped, torch.bfloat16)):
        x = p["x_TH"].to(dtype).clone().requires_grad_()
        w = p["topk_weights_TK"].clone().requires_grad_()
        y = model.experts(x, p["topk_idx_TK"].long(), w)
        y.backward(p["dy_TH"].to(dtype))
        outs[name] = [y.detach(), x.grad, w.grad, model.experts.gate_up_proj.grad,
                      model.experts.down_proj.grad]
    return outs


def test_deepseek_v4_experts_match_cpu():
    """Over the CPU stand-in kernels (fp32 math): the clamp reaches the op."""
    outs = deepseek_v4_experts_outputs("cpu")
    for i, name in enumerate(OUTPUTS):
        assert rel_err(outs["got"][i], outs["ref"][i]) <= 1e-2, name


def test_deepseek_v4_experts_match_gpu():
    require_gpu()
    outs = deepseek_v4_experts_outputs("cuda")
    rows = [(name, outs["got"][i], outs["noise"][i], outs["ref"][i])
            for i, name in enumerate(OUTPUTS)]
    assert_within_noise(rows, BF16_NOISE_ATOL, "bf16 HF loop", prefix="deepseek_v4 ")
