"""kernels/activation.py's SiLU-and-mul against the torch module it replaces, and the
engine with every norm and SiLU-and-mul on the Triton kernels
against the transformers oracle. Without CUDA under the Triton interpreter (fp32, fp16)."""
import pytest
import torch

from nanovllm.kernels.activation import silu_and_mul
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.layernorm import RMSNorm
from parity import INTERPRETER_ONLY, assert_matches_hf, make_llm, mixed_prompts

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, width", [(1, 64), (7, 3072), (33, 1500)])
def test_silu_and_mul_equals_the_torch_module(dtype: torch.dtype, rows: int, width: int) -> None:
    """Both halves of every row, widths past one block and ragged: the torch module's
    values, rounded as it rounds (exp against its own exp: one rounding apart at most)."""
    torch.manual_seed(rows * width)
    x = torch.randn(rows, 2 * width, dtype=dtype, device=DEVICE) * 4
    module = SiluAndMul()
    expected = module(x)
    got = silu_and_mul(x)
    assert got.shape == (rows, width) and got.dtype == dtype
    tolerance = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    module.use_kernel()  # the module's own switch
    assert torch.equal(module(x), got)


def test_silu_and_mul_rejects_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match=r"x \[M, 2N\]"):
        silu_and_mul(torch.randn(4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="unit stride"):
        silu_and_mul(torch.randn(8, 4, device=DEVICE).t())
    assert silu_and_mul(torch.randn(0, 8, device=DEVICE)).shape == (0, 4)


@INTERPRETER_ONLY
def test_the_engine_without_torch_compile_matches_hf(qwen3_ckpt) -> None:
    """With the Triton kernels the norms and SiLU-and-mul of prefills and decodes alike run on
    the kernels (nothing torch-compiled); greedy tokens equal the oracle's."""
    with make_llm(qwen3_ckpt, attention_backend="triton") as llm:
        modules = list(llm.executor.runner.model.modules())
        assert all(m.kernel is not None for m in modules if isinstance(m, SiluAndMul))
        assert all(m.kernel_rows > 10**9 for m in modules if isinstance(m, RMSNorm))
        assert_matches_hf(llm, qwen3_ckpt, mixed_prompts(llm.vocab_size, 16, count=4))
