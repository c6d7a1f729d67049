"""The small-batch projection kernel (kernels/gemv.py) against torch, and the linear
layers and gated MLP that use it.

Without CUDA the kernel runs under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) in float32 and float16; with CUDA also in bfloat16, with split
merges repeated for races and a CUDA-graph replay. Every input is fresh random data.
"""
import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from nanovllm.kernels.gemv import MAX_ROWS, GemvConfig, gemv
from nanovllm.layers.linear import GEMV_MAX_ROWS, ReplicatedLinear
from nanovllm.models.llama import LlamaMLP

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY),
]
# ||out - ref|| / ||ref||: the kernel accumulates in fp32; the inputs' rounding is the
# reference's too, so what is left is the output's rounding and summation order.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# Explicit splits exercise the merge also on CPU, where the default config has one split.
CONFIGS = [None, GemvConfig(block_n=16, block_k=64, num_splits=3, num_warps=4, num_stages=2)]


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    """fp32 x W^T + b; gated: silu(gate) * up in fp32, rounded to x's dtype as the kernel does."""
    if gated:
        gate, up = x.float().chunk(2, -1)
        x = (F.silu(gate) * up).to(x.dtype)
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize(("n", "k"), [(64, 128), (100, 300)], ids=["even", "ragged"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("config", CONFIGS, ids=["auto", "splits3"])
def test_gemv_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int, gated: bool, config: GemvConfig | None) -> None:
    x = torch.randn(rows, 2 * k if gated else k, dtype=dtype, device=DEVICE)
    weight = torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    for b in (None, bias):
        out = gemv(x, weight, b, gated, config)
        assert out.shape == (rows, n) and out.dtype == dtype
        assert relative_error(out, reference(x, weight, b, gated)) <= REL_TOL[dtype]


def test_gemv_reads_strided_rows() -> None:
    """x may be a view with a row stride wider than K (a slice of a larger buffer)."""
    wide = torch.randn(4, 200, device=DEVICE)
    weight = torch.randn(48, 128, device=DEVICE)
    x = wide[:, :128]
    assert relative_error(gemv(x, weight), reference(x, weight, None, False)) <= REL_TOL[torch.float32]


def test_gemv_rejects_bad_input() -> None:
    weight = torch.randn(32, 64, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.randn(MAX_ROWS + 1, 64, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"\[rows, 128\]"):
        gemv(torch.randn(2, 64, device=DEVICE), weight, gated=True)
    with pytest.raises(ValueError, match="float16"):
        gemv(torch.randn(2, 64, dtype=torch.float16, device=DEVICE), weight)
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.randn(2, 64, device=DEVICE), weight, torch.randn(31, device=DEVICE))
    assert gemv(torch.randn(0, 64, device=DEVICE), weight).shape == (0, 32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_mlp_use_the_kernel_for_small_batches(dtype: torch.dtype) -> None:
    """With the kernel set, a linear layer and the gated MLP give torch's result at every
    batch size: up to GEMV_MAX_ROWS rows through the kernel (the MLP's activation inside
    the down projection), larger batches through F.linear."""
    config = Qwen3Config(hidden_size=64, intermediate_size=160)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        linear = ReplicatedLinear(64, 96, bias=True).to(dtype)
        mlp = LlamaMLP(config).to(dtype)
    for param in [*linear.parameters(), *mlp.parameters()]:
        param.data.normal_(0, 0.1)
    for rows in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = torch.randn(rows, 64, dtype=dtype, device=DEVICE)
        expected_linear = linear(x).float()
        expected_mlp = mlp(x).float()  # no kernel: cuBLAS and the separate activation
        for module in (linear, mlp.gate_up_proj, mlp.down_proj):
            module.small_batch_kernel = gemv
        assert mlp.down_proj.takes_gated(x) == (rows <= GEMV_MAX_ROWS)
        assert relative_error(linear(x), expected_linear) <= 10 * REL_TOL[dtype]
        assert relative_error(mlp(x), expected_mlp) <= 10 * REL_TOL[dtype]
        for module in (linear, mlp.gate_up_proj, mlp.down_proj):
            module.small_batch_kernel = None


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_gemv_merge_is_race_free(dtype: torch.dtype) -> None:
    """The last split to finish merges, in split order: repeated launches over many splits
    give the same bits every time (a merge that read a split before it was written would not)."""
    x = torch.randn(8, 2 * 3072, dtype=dtype, device=DEVICE)
    weight = torch.randn(1024, 3072, dtype=dtype, device=DEVICE) / 3072**0.5
    config = GemvConfig(block_n=16, block_k=128, num_splits=12, num_warps=4, num_stages=3)
    first = gemv(x, weight, gated=True, config=config)
    assert relative_error(first, reference(x, weight, None, True)) <= REL_TOL[dtype]
    for _ in range(200):
        assert torch.equal(gemv(x, weight, gated=True, config=config), first)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_gemv_cuda_graph(dtype: torch.dtype) -> None:
    """Captured once, replayed with new inputs written in place: the result is eager's."""
    x = torch.randn(4, 1024, dtype=dtype, device=DEVICE)
    weight = torch.randn(4096, 1024, dtype=dtype, device=DEVICE) / 32
    out = torch.empty(4, 4096, dtype=dtype, device=DEVICE)
    out.copy_(gemv(x, weight))  # compile and allocate the counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(gemv(x, weight))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, gemv(x, weight))
