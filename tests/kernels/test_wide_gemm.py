"""kernels/wide_gemm.py against torch: the 16-bit tiles' SplitSum (and the RMSNorm that reads
it), their routing in the linear layers, and the FP8 form against the dequantized product,
under the interpreter on CPU (fp32, fp16, FP8 storage) and in bf16 / FP8 on CUDA (Hopper,
for the TMA copies)."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.kernels import wide_gemm
from nanovllm.kernels.rmsnorm import rms_norm
from nanovllm.kernels.split_gemm import SplitSum
from nanovllm.kernels.wide_gemm import (fp8_plan, fp8_wide_gemm, takes_fp8, takes_wide, tma_rows, wide_descriptor,
                                        wide_split_gemm)
from nanovllm.layers.quantization import quantize_per_group
from nanovllm.utils.fp8 import FP8_DTYPE

from test_split_gemm import DEVICE, DTYPES, GPU_ONLY, REL_TOL, pytestmark, relative_error  # noqa: F401 (pytestmark)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [65, 128, 200])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
# K = 600: three splits of 256 (two steps of 128 each; fp32: four of 192; the last part-filled); N = 72: two tiles,
# the second part-filled; K = 48: one split narrower than a tile.
@pytest.mark.parametrize("k,n", [(600, 72), (48, 24)])
def test_split_matches_torch(dtype, rows, bias, k, n):
    """The 16-bit tiles (65-256 rows, x by TMA in 64- or 128-row tiles): their SplitSum's sum
    equals torch's product, and the RMSNorm reading it equals RMSNorm on that sum, bit for bit."""
    torch.manual_seed(rows + k)
    x = torch.randn(rows, k, dtype=dtype, device=DEVICE)
    w = torch.randn(n, k, dtype=dtype, device=DEVICE) / k ** 0.5
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    assert takes_wide(w) and tma_rows(x)
    out = wide_split_gemm(x, w, wide_descriptor(w), b)
    splits = 1 if k == 48 else 4 if dtype == torch.float32 else 3  # fp32 steps of 64 columns: 192 a split
    assert out.parts.shape == (splits, rows, n) and out.dtype == dtype
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert relative_error(out.dense(), ref) < REL_TOL[dtype]
    residual = torch.randn(rows, n, dtype=dtype, device=DEVICE)
    norm_weight = torch.rand(n, dtype=dtype, device=DEVICE) + 0.5
    assert all(map(torch.equal, rms_norm(out, norm_weight, 1e-6, residual),
                   rms_norm(out.dense(), norm_weight, 1e-6, residual)))


def test_takes_narrow_outputs_only():
    """Only a 16-bit weight whose K is at least twice its N, and N at most WIDE_MOST_COLUMNS,
    goes to the tiles, and only rows a TMA copy can address."""
    assert takes_wide(torch.empty(64, 128)) and not takes_wide(torch.empty(65, 128))
    most = wide_gemm.WIDE_MOST_COLUMNS
    assert takes_wide(torch.empty(most, 2 * most)) and not takes_wide(torch.empty(most + 16, 4 * most))
    assert not tma_rows(torch.empty(80, 129)[:, :128]) and tma_rows(torch.empty(80, 132)[:, :128])


def test_layers_send_row_parallel_narrow_outputs_to_the_wide_tiles(monkeypatch):
    """With defer, a RowParallelLinear whose K >= 2 N (N <= WIDE_MOST_COLUMNS) sends WIDE_MIN_ROWS to WIDE_MAX_ROWS rows
    (TMA-addressable) to the wide tiles, whose SplitSum sums to torch's product; 64 and 257
    rows, rows a TMA copy cannot address, a column-parallel layer of the same shape, and
    NANOVLLM_SPLIT_GEMM_WIDE_ROWS below WIDE_MIN_ROWS stay dense."""
    from nanovllm.layers.linear import ColumnParallelLinear, Route, RowParallelLinear

    torch.manual_seed(0)
    down, column = RowParallelLinear(96, 32).to(DEVICE), ColumnParallelLinear(96, 32).to(DEVICE)
    for layer in (down, column):
        layer.weight.data.normal_()
        layer.use_small_batch_kernels()
    for rows in (64, 65, 128, 256, 257):
        x = torch.randn(rows, 96, device=DEVICE)
        assert (down.route(x, defer=True) is Route.WIDE) == (65 <= rows <= 256)
        assert column.route(x, defer=True) is not Route.WIDE
    x = torch.randn(100, 100, device=DEVICE)[:, :96]  # rows 400 bytes apart: a TMA copy's
    out = down(x, defer=True)
    assert isinstance(out, SplitSum) and relative_error(out.dense(), F.linear(x, down.weight)) < 1e-5
    assert isinstance(column(x, defer=True), torch.Tensor)
    assert down.route(torch.randn(100, 97, device=DEVICE)[:, :96], defer=True) is Route.TORCH  # 388 bytes apart
    monkeypatch.setattr(wide_gemm, "WIDE_MAX_ROWS", 0)
    off = RowParallelLinear(96, 32).to(DEVICE)
    off.use_small_batch_kernels()
    assert off.route(x, defer=True) is Route.TORCH and isinstance(off(x, defer=True), torch.Tensor)



@pytest.mark.parametrize("dtype", [pytest.param(torch.float16, id="fp16"),
                                   pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
# A square weight at 65 and 200 rows (K = N = 320: the last 256-column step part-filled, the
# third 128-row weight tile too) and outputs narrower than K (down-like, from 129 rows; N = 192,
# K = 640; N = 48, K = 96: one part-filled step and tile).
@pytest.mark.parametrize("rows,k,n", [(65, 320, 320), (200, 320, 320), (256, 640, 192), (129, 96, 48)])
def test_fp8_matches_the_dequantized_product(dtype, bias, rows, k, n, monkeypatch):
    """FP8 rows and weights with per-row and per-channel scales: the output (dense, in dtype)
    equals the product of the dequantized operands (plus the bias), rounded once."""
    monkeypatch.setattr(wide_gemm, "FP8_WIDE_MAX_ROWS", 256)
    torch.manual_seed(rows + k)
    q, q_scale = quantize_per_group(torch.randn(rows, k, device=DEVICE), k)
    w, w_scale = quantize_per_group(torch.randn(n, k, device=DEVICE) / k ** 0.5, k)
    b = torch.randn(n, dtype=dtype, device=DEVICE) if bias else None
    plan = fp8_plan(w)
    assert q.dtype == w.dtype == FP8_DTYPE and takes_fp8(q, w, plan)
    out = fp8_wide_gemm(q, q_scale, w, w_scale, b, dtype, plan)
    ref = (q.float() * q_scale) @ (w.float() * w_scale).T + (0 if b is None else b.float())
    assert out.dtype == dtype and out.shape == (rows, n)
    assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else REL_TOL[dtype])


def test_fp8_takes_its_shapes_and_rows_only(monkeypatch):
    """FP8 steps go to the tiles only from WIDE_MIN_ROWS to FP8_WIDE_MAX_ROWS rows (0: none),
    for square weights at any of those rows and outputs narrower than K from 129 (past
    channel_gemm's), in FP8 against an FP8 weight, rows TMA-addressable; wider outputs and
    16-bit weights have no plan."""
    weights = [torch.zeros(n, 64, dtype=FP8_DTYPE) for n in (64, 32)]  # square, down-like
    q = torch.zeros(256, 64, dtype=FP8_DTYPE)
    assert all(fp8_plan(torch.zeros(n, 64, dtype=FP8_DTYPE)) is None for n in (96, 256))  # q/k/v-, gate_up-like
    assert fp8_plan(torch.zeros(64, 64)) is None and fp8_plan(torch.zeros(64, 72, dtype=FP8_DTYPE)[:, :64]) is None
    plans = [fp8_plan(w) for w in weights]
    monkeypatch.setattr(wide_gemm, "FP8_WIDE_MAX_ROWS", 0)
    assert not any(takes_fp8(q[:rows], w, plan) for rows in (65, 128, 200) for w, plan in zip(weights, plans))
    monkeypatch.setattr(wide_gemm, "FP8_WIDE_MAX_ROWS", 256)
    taken = {rows: [takes_fp8(q[:rows], w, plan) for w, plan in zip(weights, plans)]
             for rows in (64, 65, 128, 129, 256)}
    assert taken == {64: [False, False], 65: [True, False], 128: [True, False], 129: [True, True], 256: [True, True]}
    square, plan = weights[0], plans[0]
    assert not takes_fp8(q.half(), square, plan) and not takes_fp8(q, square, None)
    assert not takes_fp8(torch.zeros(128, 72, dtype=FP8_DTYPE)[:, :64], square, plan)  # rows 72 bytes apart
    with pytest.raises(ValueError, match="fp8_wide_gemm takes"):
        fp8_wide_gemm(q[:64], torch.ones(64, 1), square, torch.ones(64, 1), None, torch.float16, plan)
    for q_scale, w_scale in ((torch.ones(128, 2)[:, :1], torch.ones(64, 1)), (torch.ones(128, 1), torch.ones(32, 2))):
        with pytest.raises(ValueError, match="unit stride"):  # a strided or a per-group scale
            fp8_wide_gemm(q[:128], q_scale, square, w_scale, None, torch.float16, plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tensor cores' FP8 sums need CUDA")
@pytest.mark.parametrize("rows,n", [(65, 1024), (128, 1024), (129, 512), (256, 512)])  # square, down-like
@pytest.mark.parametrize("fast", [False, True], ids=["promoted", "fast"])
def test_fp8_sums_as_channel_gemm_on_cuda(rows, n, fast, monkeypatch):
    """On the tensor cores, with the FP8 products promoted to fp32 every 128 columns, the
    form and channel_gemm agree in fp32 output to summation order; summed in the tensor
    cores' own accumulator (the default), each is within its reduced precision (an order
    below the FP8 operands' rounding) of the exact product of the quantized operands."""
    from nanovllm.kernels.decode_gemm import channel_gemm
    from nanovllm.utils import fp8 as fp8_format

    monkeypatch.setattr(wide_gemm, "FP8_WIDE_MAX_ROWS", 256)
    monkeypatch.setattr(fp8_format, "FAST_ACCUM", fast)
    torch.manual_seed(rows)
    q, q_scale = quantize_per_group(torch.randn(rows, 1024, device=DEVICE), 1024)
    w, w_scale = quantize_per_group(torch.randn(n, 1024, device=DEVICE) / 32, 1024)
    out = fp8_wide_gemm(q, q_scale, w, w_scale, None, torch.float32, fp8_plan(w))
    channel = channel_gemm(q, q_scale, w, w_scale, None, torch.float32)
    if not fast:
        assert relative_error(out, channel) < 1e-5
    exact = (q.double() * q_scale.double()) @ (w.double() * w_scale.double()).T
    assert relative_error(out, exact) < 3e-3 and relative_error(channel, exact) < 3e-3
