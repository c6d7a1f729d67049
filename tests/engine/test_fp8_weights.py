"""FP8 weights: online quantization (quantization="fp8") and block-scaled FP8 checkpoints,
on CPU through the torch path (dequantize and multiply) and the Triton kernels
(interpreter). Accuracy against the unquantized engine is test_fp8_accuracy.py's.
"""
from __future__ import annotations

import json

import pytest
import torch
from parity import INTERPRETER_ONLY, MAX_TOKENS, assert_differs_only_at_ties, make_llm, mixed_prompts
from safetensors.torch import load_file

from nanovllm import LLM, SamplingParams
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.quantization import FP8_DTYPE
from nanovllm.testing.checkpoints import hf_greedy, make_tiny_checkpoint
from nanovllm.testing.fp8_checkpoint import write_fp8_checkpoint

# Every rank's input slice of o_proj (4 heads x 64) and down_proj (256) is a whole number
# of 128-wide blocks at tensor_parallel_size 2; k_proj and v_proj (one KV head, replicated
# on both ranks) are half a block of rows.
DIMS = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=256)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8w"), "qwen3", **DIMS)


@pytest.fixture(scope="module")
def fp8_ckpt(bf16_ckpt, tmp_path_factory):
    return write_fp8_checkpoint(bf16_ckpt, tmp_path_factory.mktemp("fp8w_ckpt") / "fp8")


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(384, 16)


def assert_within_fp8_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """got: want quantized to e4m3 on a block whose scale its largest |value| / 448 bounds (half
    an e4m3 step, plus half a subnormal step), and dequantized."""
    assert ((got - want).abs() <= want.abs() * 2**-4 + want.abs().max() / 448 * 2**-9).all()


def quantized_layers(llm: LLM) -> dict[str, LinearBase]:
    return {name: m for name, m in llm.executor.runner.model.named_modules() if isinstance(m, LinearBase)}


def test_fp8_checkpoint_loads_exactly(fp8_ckpt):
    """The checkpoint's FP8 weights land bit for bit in the fused layers (q|k|v, gate|up),
    each block's scale on every one of its rows."""
    tensors = load_file(next(fp8_ckpt.glob("*.safetensors")))
    with make_llm(fp8_ckpt, num_kvcache_blocks=16) as llm:
        assert llm.config.quantization == "fp8"
        layers = quantized_layers(llm)
        attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
        for fused, parts in ((f"{attn}.qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                             (f"{mlp}.gate_up_proj", ["gate_proj", "up_proj"]),
                             (f"{attn}.o_proj", ["o_proj"]), (f"{mlp}.down_proj", ["down_proj"])):
            prefix = attn if "self_attn" in fused else mlp
            weight = torch.cat([tensors[f"{prefix}.{p}.weight"] for p in parts])
            scales = torch.cat([tensors[f"{prefix}.{p}.weight_scale_inv"].repeat_interleave(128, 0)
                                [: tensors[f"{prefix}.{p}.weight"].shape[0]] for p in parts])
            layer = layers[fused]
            assert layer.weight.dtype == FP8_DTYPE
            assert torch.equal(layer.weight.view(torch.uint8), weight.view(torch.uint8)), fused
            assert torch.equal(layer.weight_scale, scales), fused
        assert layers["model.layers.0.mlp.down_proj"].weight_scale.shape == (128, 2)  # [out, in / 128]
        assert llm.executor.runner.model.lm_head.weight.dtype == torch.float32


def test_fp8_checkpoint_matches_transformers_on_its_dequantized_weights(fp8_ckpt, prompts):
    """The weights are exactly the checkpoint's FP8 values times their scales: against that
    model in transformers, only the activations' quantization differs, so greedy tokens part
    only at near-ties: a random tiny model's logits are flat, and measured over three seeds
    the two tokens were within 0.13 of the largest |logit| where they parted."""
    with make_llm(fp8_ckpt) as llm:
        got = greedy(llm, prompts)
    oracle = fp8_ckpt / "dequantized"
    expected = hf_greedy(oracle, prompts, MAX_TOKENS, ignore_eos=True)
    assert_differs_only_at_ties(oracle, prompts, got, expected, tolerance=0.15)


@pytest.mark.parametrize("scenario", [pytest.param("triton", marks=INTERPRETER_ONLY), "tp2",
                                      pytest.param("tp2_triton", marks=[pytest.mark.slow, INTERPRETER_ONLY])])
def test_fp8_checkpoint_scenarios_give_the_same_tokens(fp8_ckpt, prompts, scenario):
    """Deterministic quantization: the Triton kernels compute what the torch path does, and
    each tensor-parallel rank quantizes whole 128-wide blocks, as one rank does."""
    # The interpreter is slow: the short prompts, 4 tokens each.
    prompts, max_tokens = (prompts, MAX_TOKENS) if scenario == "tp2" else (prompts[:5], 4)
    with make_llm(fp8_ckpt) as llm:
        expected = greedy(llm, prompts, max_tokens)
    args = {"triton": dict(attention_backend="triton"), "tp2": dict(tensor_parallel_size=2),
            "tp2_triton": dict(tensor_parallel_size=2, attention_backend="triton")}[scenario]
    with make_llm(fp8_ckpt, **args) as llm:
        assert greedy(llm, prompts, max_tokens) == expected


def test_online_quantization_per_output_channel(bf16_ckpt):
    """Each linear layer's weight becomes FP8 with one scale per output row (its largest
    |w| / 448), within half an e4m3 step of the original; the rest stays float32."""
    with make_llm(bf16_ckpt, num_kvcache_blocks=16) as plain, make_llm(bf16_ckpt, quantization="fp8") as llm:
        original = quantized_layers(plain)
        for name, layer in quantized_layers(llm).items():
            assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (layer.weight.shape[0], 1)
            w = original[name].weight
            torch.testing.assert_close(layer.weight_scale[:, 0], w.abs().amax(1) / 448)
            dequantized = layer.weight.float() * layer.weight_scale
            assert ((dequantized - w).abs() <= w.abs() * 2**-4 + layer.weight_scale * 2**-9).all(), name
        model = llm.executor.runner.model
        assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32


@INTERPRETER_ONLY
def test_online_quantization_triton_kernels_give_the_torch_tokens(bf16_ckpt, prompts):
    with make_llm(bf16_ckpt, quantization="fp8") as llm:
        expected = greedy(llm, prompts[:5], 4)
    with make_llm(bf16_ckpt, quantization="fp8", attention_backend="triton") as llm:
        # the norms before q/k/v and gate_up quantize for them (kernels/rmsnorm.py), and
        # SiLU-and-mul for down_proj (kernels/activation.py)
        layers = llm.executor.runner.model.model.layers
        assert all(layer.input_layernorm.quantize and layer.post_attention_layernorm.quantize
                   and layer.mlp.act_fn.quantize for layer in layers)
        assert greedy(llm, prompts[:5], 4) == expected


@INTERPRETER_ONLY
def test_fp8_wide_tiles_give_the_torch_tokens(bf16_ckpt, prompts, monkeypatch):
    """A prefill step of 129-256 tokens takes the FP8 projections of the shapes the FP8 tiles
    take (o_proj and down_proj, outputs narrower than K) through kernels/wide_gemm.py: the
    torch path's tokens."""
    from nanovllm.kernels import wide_gemm

    chunk = prompts[4:]  # 171 tokens: one prefill step
    rows = sum(map(len, chunk))
    assert 128 < rows <= 256
    with make_llm(bf16_ckpt, quantization="fp8") as llm:
        expected = greedy(llm, chunk, 3)
    calls, original = [], wide_gemm.fp8_wide_gemm
    monkeypatch.setattr(wide_gemm, "FP8_WIDE_MAX_ROWS", 256)
    monkeypatch.setattr(wide_gemm, "fp8_wide_gemm",
                        lambda q, q_scale, weight, *args: calls.append((q.shape[0], weight.data_ptr()))
                        or original(q, q_scale, weight, *args))
    with make_llm(bf16_ckpt, quantization="fp8", attention_backend="triton") as llm:
        assert greedy(llm, chunk, 3) == expected
        layers = llm.executor.runner.model.model.layers
        taken = sorted(proj.weight.data_ptr() for layer in layers
                       for proj in (layer.self_attn.o_proj, layer.mlp.down_proj))
    assert sorted(ptr for n, ptr in calls if n == rows) == taken and {ptr for _, ptr in calls} <= set(taken)


def test_online_quantization_keeps_moe_routers_and_quantizes_experts(qwen3_moe_ckpt):
    """The router stays float32; each expert's gate, up and down weight becomes FP8 with one
    scale per block (32 x 32 here: the largest of 128, 64 and 32 that divides inter's 32 rows),
    within FP8's rounding."""
    with make_llm(qwen3_moe_ckpt, num_kvcache_blocks=16) as plain, \
            make_llm(qwen3_moe_ckpt, quantization="fp8", num_kvcache_blocks=16) as llm:
        layers = quantized_layers(llm)
        assert layers["model.layers.0.mlp.gate"].weight.dtype == torch.float32  # the router
        assert layers["model.layers.0.self_attn.qkv_proj"].weight.dtype == FP8_DTYPE
        mlp, original = (m.executor.runner.model.model.layers[0].mlp for m in (llm, plain))
        assert mlp.w13.dtype == mlp.w2.dtype == FP8_DTYPE and mlp.scales.block == 32
        assert mlp.w13_scale.shape == (8, 2, 2) and mlp.w2_scale.shape == (8, 2, 1)  # hidden 64, inter 32
        for e in range(mlp.num_experts):
            for got, want in zip(mlp.scales.dequantized(mlp.w13, mlp.w2, e, torch.float32),
                                 (original.w13[e], original.w2[e])):
                assert_within_fp8_rounding(got, want)
        moe = [m for m in llm.executor.runner.model.modules() if hasattr(m, "scales")]
        assert llm.executor.experts()[1] == sum(t.numel() * t.element_size() for m in moe  # the benchmarks' floor
                                                for t in (m.w13, m.w2, m.w13_scale, m.w2_scale))
        assert len(greedy(llm, [[5, 6, 7]])[0]) == MAX_TOKENS


@pytest.mark.parametrize("fp8_routers", [False, True], ids=["routers_kept", "routers_fp8"])
def test_fp8_moe_checkpoint_loads_its_experts_in_fp8(qwen3_moe_ckpt, tmp_path, prompts, fp8_routers):
    """An MoE model's FP8 release (experts in FP8; routers named in modules_to_not_convert,
    as Qwen's, or in FP8 too): attention, dense MLPs and the experts load as stored (the
    experts' block scales beside them), routers at their dequantized values in the model's
    dtype, so against transformers on those values only the activations' quantization
    differs."""
    fp8 = write_fp8_checkpoint(qwen3_moe_ckpt, tmp_path / "moe_fp8", fp8_routers=fp8_routers)
    assert ("modules_to_not_convert" in json.loads((fp8 / "config.json").read_text())["quantization_config"]) \
        != fp8_routers
    oracle = load_file(next((fp8 / "dequantized").glob("*.safetensors")))
    stored = load_file(next(fp8.glob("*.safetensors")))
    with make_llm(fp8) as llm:
        layers, mlp = quantized_layers(llm), llm.executor.runner.model.model.layers[0].mlp
        assert layers["model.layers.0.self_attn.qkv_proj"].weight.dtype == FP8_DTYPE
        assert layers["model.layers.1.mlp.down_proj"].weight.dtype == FP8_DTYPE  # layer 1's dense MLP
        assert torch.equal(mlp.gate.weight, oracle["model.layers.0.mlp.gate.weight"])
        assert mlp.w13.dtype == mlp.w2.dtype == FP8_DTYPE
        for e in range(mlp.num_experts):
            parts = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            assert torch.equal(mlp.w13[e].view(torch.uint8),
                               torch.cat([stored[parts[0]], stored[parts[1]]]).view(torch.uint8))
            assert torch.equal(mlp.w13_scale[e], torch.cat([stored[parts[0] + "_scale_inv"],
                                                            stored[parts[1] + "_scale_inv"]]))
            w13, w2 = mlp.scales.dequantized(mlp.w13, mlp.w2, e, torch.float32)
            assert torch.equal(w13, torch.cat([oracle[parts[0]], oracle[parts[1]]]))
            assert torch.equal(w2, oracle[parts[2]])
        got = greedy(llm, prompts)
    expected = hf_greedy(fp8 / "dequantized", prompts, MAX_TOKENS, ignore_eos=True)
    assert_differs_only_at_ties(fp8 / "dequantized", prompts, got, expected, tolerance=0.15)


@INTERPRETER_ONLY
def test_fp8_moe_checkpoint_triton_kernels_give_the_torch_tokens(qwen3_moe_ckpt, tmp_path, prompts):
    """The fused MoE kernel over FP8 experts (and the block-scaled GEMM around it) gives the torch path's tokens."""
    fp8 = write_fp8_checkpoint(qwen3_moe_ckpt, tmp_path / "moe_fp8")
    with make_llm(fp8) as llm:
        expected = greedy(llm, prompts[:5], 4)
    with make_llm(fp8, attention_backend="triton") as llm:
        assert greedy(llm, prompts[:5], 4) == expected


def test_fp8_moe_checkpoint_whose_blocks_a_rank_would_cut_is_quantized_again(tmp_path, prompts):
    """At tensor_parallel_size 2 each rank's 16 rows of inter would cut the checkpoint's
    128-row blocks: its experts load dequantized and are quantized again on the rank, on
    128-wide blocks of its own rows (within FP8's rounding of the checkpoint's values). Not
    compared token by token: a rounding that moves an expert's output can flip a token's
    routing, which no longer is a near-tie of the logits."""
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", **DIMS)  # 32 rows of inter: 16 per rank
    fp8 = write_fp8_checkpoint(moe, tmp_path / "moe_fp8")
    oracle = load_file(next((fp8 / "dequantized").glob("*.safetensors")))
    with make_llm(fp8, tensor_parallel_size=2) as llm:
        mlp = llm.executor.runner.model.model.layers[0].mlp  # rank 0's
        assert mlp.w13.dtype == FP8_DTYPE and mlp.w13.shape == (8, 32, 128) and mlp.scales.block == 128
        for e in range(mlp.num_experts):
            parts = [oracle[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")]
            for got, want in zip(mlp.scales.dequantized(mlp.w13, mlp.w2, e, torch.float32),
                                 (torch.cat([parts[0][:16], parts[1][:16]]), parts[2][:, :16])):
                assert_within_fp8_rounding(got, want)
        assert all(len(tokens) == MAX_TOKENS for tokens in greedy(llm, prompts))


def test_fp8_moe_checkpoint_sliced_in_whole_blocks_loads_as_stored(tmp_path, prompts):
    """At tensor_parallel_size 2 with 32-wide blocks, each rank's 32 rows of inter are whole
    blocks: its slice of every expert and of its scales loads as stored (rank 0's checked
    here; a wrong offset on rank 1 would part from transformers far from any tie)."""
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", **DIMS, moe={"moe_intermediate_size": 64})
    fp8 = write_fp8_checkpoint(moe, tmp_path / "moe_fp8", block=32)
    stored = load_file(next(fp8.glob("*.safetensors")))
    with make_llm(fp8, tensor_parallel_size=2) as llm:
        mlp = llm.executor.runner.model.model.layers[0].mlp
        assert mlp.scales.block == 32 and mlp.w13_scale.shape == (8, 2, 4) and mlp.w2_scale.shape == (8, 4, 1)
        for e in range(mlp.num_experts):
            parts = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            assert torch.equal(mlp.w13[e].view(torch.uint8),
                               torch.cat([stored[parts[0]][:32], stored[parts[1]][:32]]).view(torch.uint8))
            assert torch.equal(mlp.w13_scale[e], torch.cat([stored[parts[0] + "_scale_inv"][:1],
                                                            stored[parts[1] + "_scale_inv"][:1]]))
            assert torch.equal(mlp.w2_scale[e], stored[parts[2] + "_scale_inv"][:, :1])
        got = greedy(llm, prompts)
    expected = hf_greedy(fp8 / "dequantized", prompts, MAX_TOKENS, ignore_eos=True)
    assert_differs_only_at_ties(fp8 / "dequantized", prompts, got, expected, tolerance=0.15)


def test_fp8_moe_checkpoint_under_expert_parallelism_loads_whole_experts_as_stored(tmp_path, prompts):
    """enable_expert_parallel at tensor_parallel_size 2: each rank holds four whole experts in FP8,
    their block scales as stored, and the tokens part from transformers on the dequantized
    weights only at near-ties."""
    moe = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", **DIMS)
    fp8 = write_fp8_checkpoint(moe, tmp_path / "moe_fp8")
    stored = load_file(next(fp8.glob("*.safetensors")))
    with make_llm(fp8, tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        mlp = llm.executor.runner.model.model.layers[0].mlp  # rank 0's: experts 0-3
        assert mlp.w13.dtype == FP8_DTYPE and mlp.w13.shape == (4, 64, 128)
        for e in range(4):
            down = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
            assert torch.equal(mlp.w2[e].view(torch.uint8), stored[down].view(torch.uint8))
            assert torch.equal(mlp.w2_scale[e], stored[down + "_scale_inv"])
        got = greedy(llm, prompts)
    expected = hf_greedy(fp8 / "dequantized", prompts, MAX_TOKENS, ignore_eos=True)
    assert_differs_only_at_ties(fp8 / "dequantized", prompts, got, expected, tolerance=0.15)


def test_unsupported_quantization_configs_are_refused(bf16_ckpt, fp8_ckpt, tmp_path):
    def with_config(src, name: str, **quantization_config):
        import shutil

        path = tmp_path / name
        shutil.copytree(src, path)
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {**config.get("quantization_config", {}), **quantization_config}
        (path / "config.json").write_text(json.dumps(config))
        return path

    cases = [
        (with_config(bf16_ckpt, "awq", quant_method="awq"), "quant_method 'awq'"),
        (with_config(fp8_ckpt, "static", activation_scheme="static"), "dynamic activation scales"),
        (with_config(fp8_ckpt, "per_tensor", weight_block_size=None), "block-wise"),
        (with_config(fp8_ckpt, "kept", modules_to_not_convert=["model.layers.0.mlp.down_proj"]), "unquantized"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            make_llm(path)
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        make_llm(bf16_ckpt, quantization="int4")


def test_fp8_checkpoint_slices_must_be_whole_blocks(tmp_path):
    """A rank's input slice that is not whole 128-wide blocks would mix two blocks' scales."""
    path = make_tiny_checkpoint(tmp_path / "odd", "qwen3", hidden_size=128, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, intermediate_size=256)
    fp8 = write_fp8_checkpoint(path, tmp_path / "odd_fp8")
    with pytest.raises(ValueError, match="multiple of 128"):
        make_llm(fp8, tensor_parallel_size=2)  # o_proj: 2 heads x 32 = 64 inputs per rank
