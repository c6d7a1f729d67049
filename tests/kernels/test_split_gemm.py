"""kernels/split_gemm.py against torch, and the kernels that read its SplitSum (RMSNorm with
the residual add, SiLU-and-mul, rotary_store, decode attention with rotary_store inside)
against the same kernels on the summed output: under the interpreter on CPU (fp32, fp16) and
in bf16 on CUDA (Hopper, for the TMA copies), where a chain of them is also replayed in a
CUDA graph."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.kernels.decode_attention import decode_attention_with_config
from nanovllm.kernels.decode_config import DecodeConfig
from nanovllm.kernels.rmsnorm import rms_norm
from nanovllm.kernels.rotary_store import rotary_store
from nanovllm.kernels.split_gemm import SplitSum, block_k, split_gemm, supports, weight_descriptor
from nanovllm.utils.context import Rotary

HAS_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")]
pytestmark = pytest.mark.skipif(torch.cuda.is_available() and not HAS_HOPPER, reason="TMA copies need Hopper")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)]
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def relative_error(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def project(x, w, b=None) -> SplitSum:
    return split_gemm(x, w, weight_descriptor(w), b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 9, 16, 33, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
# K = 600: two splits of 512 columns in 16 bits, three of 256 in fp32, the last part-filled;
# N = 72: two tiles, the second part-filled; K = 40: one split narrower than a tile.
@pytest.mark.parametrize("k,n", [(600, 72), (40, 136)])
def test_matches_torch(dtype, rows, bias, k, n):
    torch.manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    out = project(x, w, b)
    assert out.parts.shape == (-(-k // block_k(k, x.element_size())), rows, n)
    assert out.parts.dtype == torch.float32 and out.dtype == dtype and out.shape == (rows, n)
    dense = out.dense()
    assert dense.dtype == dtype
    assert relative_error(dense, F.linear(x.float(), w.float(), None if b is None else b.float())) < REL_TOL[dtype]


def test_a_split_is_a_kilobyte_of_each_weight_row():
    assert block_k(600, 2) == 512 and block_k(600, 4) == 256  # 16-bit and fp32 weights
    assert block_k(40, 2) == 64 and block_k(8, 4) == 16  # a short K: the next power of two, at least 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_readers_sum_as_dense(dtype):
    """RMSNorm (with the residual) and SiLU-and-mul on a SplitSum equal the same kernels
    on its dense sum: the splits are added in split order and rounded once, bit for bit."""
    torch.manual_seed(0)
    rows, k, hidden = 12, 1096, 96  # three splits in 16 bits, five in fp32
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    residual = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    norm_weight = torch.rand(hidden, dtype=dtype, device=DEVICE) + 0.5
    out = project(x, torch.randn(hidden, k, dtype=dtype, device=DEVICE) / k ** 0.5)
    assert out.parts.shape[0] == (3 if x.element_size() == 2 else 5)
    normed, res = rms_norm(out, norm_weight, 1e-6, residual)
    normed_ref, res_ref = rms_norm(out.dense(), norm_weight, 1e-6, residual)
    assert torch.equal(res, res_ref) and torch.equal(normed, normed_ref)
    gate_up = project(x, torch.randn(2 * hidden, k, dtype=dtype, device=DEVICE) / k ** 0.5)
    assert torch.equal(silu_and_mul(gate_up), silu_and_mul(gate_up.dense()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "bias"])
@pytest.mark.parametrize("cache", ["model", "e4m3"])
def test_rotary_store_sums_as_dense(dtype, qk_norm, cache):
    """q/k/v as a SplitSum (with a bias in split 0), Qwen3's q/k norms or Qwen2's bias alone,
    into a cache of the model's dtype or FP8: rotary_store's queries and stored keys and
    values equal what it makes of the dense sum, bit for bit, padding rows included."""
    torch.manual_seed(1)
    rows, k, heads, kv_heads, head_dim, block_size = 13, 1040, 4, 2, 64, 16  # three splits in 16 bits, five in fp32
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    n = (heads + 2 * kv_heads) * head_dim
    w, b = torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5, torch.randn(n, dtype=dtype, device=DEVICE)
    qkv = project(x, w, b)
    assert qkv.parts.shape[0] == (3 if x.element_size() == 2 else 5)
    positions = torch.randint(0, 100, (rows,), device=DEVICE)
    slots = torch.randperm(4 * block_size, device=DEVICE)[:rows]
    slots[5] = -1
    angles = torch.rand(100, head_dim // 2, device=DEVICE) * 6
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    norms = [torch.rand(head_dim, dtype=dtype, device=DEVICE) + 0.5 for _ in range(2)] if qk_norm else [None, None]
    cache_dtype = torch.float8_e4m3fn if cache == "e4m3" else dtype
    scales = torch.tensor([0.05, 0.03], device=DEVICE) if cache == "e4m3" else None
    outputs = []
    for given in (qkv, qkv.dense()):
        caches = [torch.zeros(4, block_size, kv_heads, head_dim, device=DEVICE).to(cache_dtype) for _ in range(2)]
        q = rotary_store(given, positions, cos_sin, *caches, slots, heads, *norms, eps=1e-6, kv_scales=scales)
        outputs.append((q, *(c.view(torch.uint8) if cache == "e4m3" else c for c in caches)))
    assert outputs[0][0].dtype == dtype
    assert outputs[0][1].any()  # keys were stored
    for got, want in zip(*outputs):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", ["model", "e4m3"])
def test_fused_decode_attention_sums_as_dense(dtype, cache):
    """decode_attention_rotary (rotary_store inside decode attention) on q/k/v as a SplitSum:
    its output and the keys and values it stores equal what it makes of the dense sum, bit
    for bit; with two splits of a row, so that a program without the newest token reads it."""
    torch.manual_seed(2)
    rows, k, heads, kv_heads, head_dim, block_size = 5, 520, 4, 2, 64, 16
    contexts = [33, 1, 0, 20, 64]
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = torch.randn((heads + 2 * kv_heads) * head_dim, k, dtype=dtype, device=DEVICE) / k ** 0.5
    qkv = project(x, w)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    block_tables = torch.arange(rows * 4, dtype=torch.int32, device=DEVICE).view(rows, 4)
    angles = torch.rand(100, head_dim // 2, device=DEVICE) * 6
    norms = [torch.rand(head_dim, dtype=dtype, device=DEVICE) + 0.5 for _ in range(2)]
    rotary = Rotary((lens - 1).clamp(min=0).long(), torch.cat([angles.cos(), angles.sin()], dim=1), *norms, eps=1e-6)
    cache_dtype = torch.float8_e4m3fn if cache == "e4m3" else dtype
    scales = torch.tensor([0.05, 0.03], device=DEVICE) if cache == "e4m3" else None
    history = [torch.randn(rows * 4, block_size, kv_heads, head_dim, device=DEVICE).to(cache_dtype) for _ in range(2)]
    outputs = []
    for given in (qkv, qkv.dense()):
        caches = [c.clone() for c in history]
        out = decode_attention_with_config(given, *caches, block_tables, lens, head_dim**-0.5,
                                           DecodeConfig(2, 16, 4, 2), kv_scales=scales, rotary=rotary)
        outputs.append((out, *(c.view(torch.uint8) if cache == "e4m3" else c for c in caches)))
    assert outputs[0][0].dtype == dtype and outputs[0][0].shape == (rows, heads, head_dim)
    assert not torch.equal(outputs[0][1], history[0].view(torch.uint8) if cache == "e4m3" else history[0])  # stored
    for got, want in zip(*outputs):
        assert torch.equal(got, want)


def test_refusals():
    w = torch.randn(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        project(torch.randn(65, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight's dtype"):
        project(torch.randn(9, 32, device=DEVICE, dtype=torch.float16), w)
    assert not supports(torch.randn(8, 6))  # rows of 24 bytes: no TMA copy
    out = project(torch.randn(9, 32, device=DEVICE), w)
    with pytest.raises(ValueError, match="with a residual"):
        rms_norm(out, torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="does not quantize"):
        silu_and_mul(out, quantize=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_HOPPER, reason="needs a Hopper GPU")
def test_graph_replay_of_a_pdl_chain():
    """norm -> split GEMM -> SiLU-and-mul -> split GEMM -> norm, PDL-chained, captured in a
    CUDA graph: every replay equals the eager run bit for bit."""
    torch.manual_seed(0)
    dtype, rows, hidden, inter = torch.bfloat16, 24, 1024, 3072
    h = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    res = torch.randn(rows, hidden, dtype=dtype, device=DEVICE)
    gate_up = torch.randn(2 * inter, hidden, dtype=dtype, device=DEVICE) / hidden ** 0.5
    down = torch.randn(hidden, inter, dtype=dtype, device=DEVICE) / inter ** 0.5
    norm_w = torch.ones(hidden, dtype=dtype, device=DEVICE)
    gu_desc, down_desc = weight_descriptor(gate_up), weight_descriptor(down)

    def chain():
        x, r = rms_norm(h, norm_w, 1e-6, res)
        y = split_gemm(silu_and_mul(split_gemm(x, gate_up, gu_desc)), down, down_desc)
        return rms_norm(y, norm_w, 1e-6, r)[0]

    eager = chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)

