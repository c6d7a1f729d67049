"""The penalty kernel (kernels/penalize.py) against the sampler's torch path (sampling/ops.py's
penalize), value for value. Without CUDA it runs under the Triton interpreter; with CUDA
also on bf16 logits of Qwen's vocabulary. Every input is fresh random data."""
import pytest
import torch

from nanovllm.kernels.penalize import penalize_logits
from nanovllm.sampling.ops import penalize

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
GPU_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


def random_penalties(batch: int, vocab: int, slots: int) -> tuple[torch.Tensor, ...]:
    """Tables with a mix of unseen, generated and prompt tokens; rows in any order of the
    slots; every row's three penalties different, one row with them all off."""
    counts = torch.randint(0, 4, (slots, vocab), dtype=torch.int32, device=DEVICE)
    counts[counts == 3] = 0  # most tokens unseen
    in_prompt = torch.rand(slots, vocab, device=DEVICE) < 0.2
    rows = torch.randperm(slots, device=DEVICE)[:batch]
    repetition = torch.rand(batch, device=DEVICE) + 0.6
    frequency = torch.rand(batch, device=DEVICE) - 0.3
    presence = torch.rand(batch, device=DEVICE) * 2 - 1
    repetition[0], frequency[0], presence[0] = 1.0, 0.0, 0.0
    return counts, in_prompt, rows, repetition, frequency, presence


def check(batch: int, vocab: int, dtype: torch.dtype) -> None:
    logits = (torch.randn(batch, vocab, device=DEVICE) * 5).to(dtype)
    tables = random_penalties(batch, vocab, batch + 3)
    got = penalize_logits(logits, *tables)
    assert got.dtype == torch.float32
    assert torch.equal(got, penalize(logits.float(), tables))
    assert torch.equal(got[0], logits[0].float())  # penalties off: the logits as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("vocab", [384, 5000], ids=["one_chunk", "ragged"])
def test_penalize_equals_the_torch_path(dtype: torch.dtype, vocab: int) -> None:
    check(5, vocab, dtype)


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16", marks=GPU_ONLY)])
def test_penalize_large_batch(dtype: torch.dtype) -> None:
    check(256, 151936, dtype)


def test_shared_slots_strided_logits_and_infinities() -> None:
    """Rows sharing a slot, logits as a view with a longer row stride, int32 rows, -inf
    logits (banned tokens) and batch 1: still the torch path's values."""
    vocab = 1000
    wide = torch.randn(3, vocab + 24, device=DEVICE) * 5
    logits = wide[:, :vocab]
    logits[1, ::7] = float("-inf")
    counts, in_prompt, _, repetition, frequency, presence = random_penalties(3, vocab, 2)
    rows = torch.tensor([1, 1, 0], dtype=torch.int32, device=DEVICE)
    tables = (counts, in_prompt, rows, repetition, frequency, presence)
    assert torch.equal(penalize_logits(logits, *tables), penalize(logits.float(), tables))
    one = (counts, in_prompt, rows[:1], repetition[:1], frequency[:1], presence[:1])
    assert torch.equal(penalize_logits(logits[:1], *one), penalize(logits[:1].float(), one))


def test_tables_of_another_width_are_refused() -> None:
    logits = torch.randn(2, 64, device=DEVICE)
    tables = random_penalties(2, 32, 4)
    with pytest.raises(ValueError, match="penalty tables must be"):
        penalize_logits(logits, *tables)
