"""kernels/decode_gemm.py's GEMM of 16-bit (and fp32) decode batches against torch, under
the Triton interpreter on CPU (fp32, fp16) and on CUDA (bf16); its FP8 form, channel_gemm,
is tested in test_fp8_gemm.py."""
import pytest
import torch
from test_gemv import DEVICE, DTYPES, REL_TOL, reference, relative_error

from nanovllm.kernels.decode_gemm import TileConfig, decode_gemm, supports, tile_config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "N", "K"), [(9, 64, 128), (16, 200, 320), (33, 128, 640), (70, 96, 256)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_decode_gemm_matches_torch(dtype, M, N, K, splits, bias):
    """Partial tiles of tokens, channels and K; K cut into splits merged in the launch."""
    torch.manual_seed(M * N)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    w = torch.randn(N, K, dtype=dtype, device=DEVICE) * 0.05
    b = torch.randn(N, dtype=dtype, device=DEVICE) if bias else None
    config = TileConfig(block_n=64, block_t=min(64, max(16, 1 << (M - 1).bit_length())), block_k=32, splits=splits,
                        num_stages=2)
    out = decode_gemm(x, w, b, config)
    assert out.dtype == dtype and out.shape == (M, N)
    assert relative_error(out, reference(x, w, b, False)) < REL_TOL[dtype]
    assert torch.equal(decode_gemm(x, w, b, config), out)  # the split counters left at zero


def test_decode_gemm_default_tile_and_bad_inputs():
    x = torch.randn(12, 256, device=DEVICE)
    w = torch.randn(96, 256, device=DEVICE)
    config = tile_config(12, 96, 256, itemsize=2)
    assert (config.block_t, config.block_k) == (16, 64)  # 128 bytes of each row per K step
    assert relative_error(decode_gemm(x, w), reference(x, w, None, False)) < REL_TOL[torch.float32]
    assert supports(w) and not supports(w.t())
    with pytest.raises(ValueError, match="decode_gemm takes"):
        decode_gemm(x.half(), w)
