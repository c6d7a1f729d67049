"""The decode batches' kernels against torch: kernels/gemv.py (x W^T (+ b) and the gated
SiLU-and-mul form) and kernels/rmsnorm.py, under the interpreter on CPU (fp32, fp16) and
in bf16 on CUDA, where PDL launches are also replayed in a CUDA graph as a chain of
dependent kernels."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.gemv import GEMV_MAX_ROWS, gemv, supports
from nanovllm.kernels.rmsnorm import rms_norm
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, Route
from nanovllm.kernels.pdl import pdl_enabled

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)]
# Relative to the output's norm: fp32 sums in another order than torch; 16-bit outputs round.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(x, w, b, gated):
    y = F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    if gated:
        gate, up = y.chunk(2, -1)
        y = (F.silu(gate.float()) * up.float()).to(x.dtype)
    return y


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
# K = 1000 is no power of two; with K = 1000 a program holds 8 rows, so 36 outputs need
# five programs and the last is part-masked; K = 40 puts everything in one program.
@pytest.mark.parametrize("k,n", [(1000, 72), (40, 36)])
def test_matches_torch(dtype, rows, gated, bias, k, n):
    torch.manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = (torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5)
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    out = gemv(x, w, b, gated=gated)
    assert out.shape == (rows, n // 2 if gated else n) and out.dtype == dtype
    assert relative_error(out, reference(x, w, b, gated)) < REL_TOL[dtype]


def test_strided_rows_and_refusals():
    x = torch.randn(4, 64, device=DEVICE)
    w = torch.randn(20, 32, device=DEVICE)
    view = x[:, :32]  # row stride 64
    assert relative_error(gemv(view, w), reference(view, w, None, False)) < 1e-5
    with pytest.raises(ValueError, match=f"up to {GEMV_MAX_ROWS} rows"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 32, device=DEVICE), w)
    assert not supports(torch.randn(3, 8), gated=True)  # an odd [gate | up]
    assert not supports(torch.randn(8, 8).t())  # not contiguous
    assert supports(torch.randn(4, 8192)) and not supports(torch.randn(4, 2 * 8192))  # K up to one slab
    assert supports(torch.randn(4, 4096), gated=True) and not supports(torch.randn(4, 8192), gated=True)
    assert gemv(torch.randn(0, 32, device=DEVICE), w).shape == (0, 20)
    if not HAS_CUDA:
        assert not pdl_enabled(DEVICE)


@pytest.mark.parametrize("switched_on", [False, True], ids=["torch", "kernels"])
def test_layers_route_only_what_the_kernels_take(switched_on):
    """The layers send 1 to GEMV_MAX_ROWS rows of a 2-D input with unit stride to the kernels once
    switched on; zero rows, more rows, 3-D and strided inputs go the torch way."""
    torch.manual_seed(0)
    proj = ReplicatedLinear(32, 24).to(DEVICE)
    gate_up = MergedColumnParallelLinear(32, [16, 16]).to(DEVICE)
    norm = RMSNorm(32).to(DEVICE)
    for layer in (proj, gate_up):
        layer.weight.data.normal_()
    if switched_on:
        proj.use_small_batch_kernels(), gate_up.use_small_batch_kernels(), norm.use_kernel()
    assert proj.route(torch.randn(2, 32, device=DEVICE), gated=True) is not Route.GATED  # not [gate | up]
    for x in (torch.randn(0, 32), torch.randn(3, 32), torch.randn(12, 32), torch.randn(2, 3, 32),
              torch.randn(3, 64)[:, ::2]):
        x = x.to(DEVICE)
        assert relative_error(proj(x), F.linear(x, proj.weight)) < 1e-5 if x.numel() else proj(x).shape == (0, 24)
        assert relative_error(norm(x), RMSNorm.rms_forward(norm, x)) < 1e-6 if x.numel() else norm(x).shape == (0, 32)
        flat = x.dim() == 2 and x.stride(-1) == 1
        gated = gate_up.route(x, gated=True) is Route.GATED
        assert gated == (switched_on and flat and 0 < x.shape[0] <= GEMV_MAX_ROWS)
    x = torch.randn(3, 32, device=DEVICE)
    if switched_on:
        assert relative_error(gate_up(x, gated=True), reference(x, gate_up.weight, None, True)) < 1e-5
    else:
        with pytest.raises(ValueError, match="needs the GEMV kernel"):
            gate_up(x, gated=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("hidden", [64, 1000])
def test_rms_norm_matches_the_torch_module(dtype, residual, hidden):
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, eps=1e-6).to(DEVICE, dtype)
    norm.weight.data.normal_(1.0, 0.1)
    x = torch.randn(5, hidden, dtype=dtype, device=DEVICE) * 3
    r = torch.randn(5, hidden, dtype=dtype, device=DEVICE) if residual else None
    expected = norm(x, r) if residual else (norm(x),)
    out = rms_norm(x, norm.weight, norm.eps, r) if residual else (rms_norm(x, norm.weight, norm.eps),)
    for got, want in zip(out, expected, strict=True):
        assert got.dtype == dtype
        # One rounding apart at most (rsqrt against 1 / sqrt).
        assert relative_error(got, want) < {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    norm.use_kernel()  # the module's own switch to the kernel
    again = norm(x, r) if residual else (norm(x),)
    assert all(torch.equal(a, b) for a, b in zip(again, out, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pdl", ["1", "0"], ids=["pdl", "no-pdl"])
def test_chain_in_a_cuda_graph_replays_bit_identically(pdl, monkeypatch):
    """Projections that read each other's outputs, PDL-launched inside one CUDA graph: each
    waits for the one before (else it would read stale inputs), replays give the same bits,
    and the result equals the eager chain's."""
    monkeypatch.setenv("NANOVLLM_PDL", pdl)
    torch.manual_seed(0)
    dtype, hidden, inter = torch.bfloat16, 1024, 3072
    layers = [(torch.randn(4096, hidden, dtype=dtype, device="cuda") / 32,
               torch.randn(hidden, 2048, dtype=dtype, device="cuda") / 45,
               torch.randn(2 * inter, hidden, dtype=dtype, device="cuda") / 32,
               torch.randn(hidden, inter, dtype=dtype, device="cuda") / 55) for _ in range(4)]
    x = torch.randn(1, hidden, dtype=dtype, device="cuda")

    norm_weight = torch.ones(hidden, dtype=dtype, device="cuda")

    def chain(h, project, norm=lambda h, r: rms_norm(h, norm_weight, 1e-6, r)):
        residual = torch.zeros_like(h)
        for qkv, o, gate_up, down in layers:
            h, residual = norm(h, residual)
            h = project(project(h, qkv)[:, :2048].contiguous(), o)
            h, residual = norm(h, residual)
            h = project(project(h, gate_up, gated=True), down)
        return h + residual

    eager = chain(x, gemv)
    torch_norm = RMSNorm(hidden).to("cuda", dtype)
    expected = chain(x, lambda h, w, gated=False: reference(h, w, None, gated), torch_norm)
    assert relative_error(eager, expected) < 2e-2
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(static_x, gemv)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static_x, gemv)
    results = []
    for _ in range(20):
        graph.replay()
        results.append(out.clone())
    torch.cuda.synchronize()
    assert all(torch.equal(r, eager) for r in results)
