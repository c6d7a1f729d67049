"""The sampler on its own: distributions, filters, penalties, seeded draws, logprobs."""
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from nanovllm.sampling.logits_processors import MinTokensProcessor
from nanovllm.sampling.ops import chunk_width, penalize, row_argmax, top_candidates
from nanovllm.sampling.sampler import Penalties, Sampler, SamplingTensors
from nanovllm.utils.compile import set_compile_enabled
from nanovllm.utils.keyed_noise import keyed_exponential, open_unit_interval

# 0.999 quantiles of chi-square with 2, 3 and 4 degrees of freedom.
CHI2_999 = {2: 13.8, 3: 16.3, 4: 18.5}


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    expected = probs[keep] * observed.sum()
    return (((observed[keep] - expected) ** 2) / expected).sum().item()


def sample(logits: torch.Tensor, temperature: float = 1.0, **extra) -> torch.Tensor:
    n = logits.size(0)
    t = SamplingTensors(torch.full((n,), temperature))
    filters = {k: extra.pop(k) for k in ("top_k", "top_p", "min_p") if k in extra}
    if filters:
        top_k = filters.get("top_k", 0)
        t.filters = (torch.full((n,), top_k, dtype=torch.int64), torch.full((n,), filters.get("top_p", 1.0)),
                     torch.full((n,), filters.get("min_p", 0.0)))
        t.max_top_k, t.all_top_k = top_k, top_k > 0
    for name, value in extra.items():
        setattr(t, name, value)
    return Sampler()(logits, t)[0]


def test_temperature_zero_is_argmax():
    logits = torch.randn(16, 50)
    assert torch.equal(sample(logits, 0.0), logits.argmax(-1))
    assert torch.equal(sample(logits, 0.0, top_k=3, top_p=0.5), logits.argmax(-1))


def test_samples_follow_the_softmax_distribution():
    """One sequence's draws over 40,000 positions."""
    n, temperature = 40_000, 0.7
    row = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    tokens = sample(row.expand(n, -1).contiguous(), temperature, keys=torch.full((n,), 12345), positions=torch.arange(n))
    observed = torch.bincount(tokens, minlength=5).double()
    assert chi_square(observed, torch.softmax(row.double() / temperature, -1)) < CHI2_999[4]


def filtered_probs(row: torch.Tensor, keep: list[int]) -> torch.Tensor:
    mask = torch.zeros_like(row, dtype=torch.bool)
    mask[keep] = True
    return torch.softmax(row.double().masked_fill(~mask, float("-inf")), -1)


@pytest.mark.parametrize(
    ("filters", "keep"),
    [
        (dict(top_k=3), [0, 1, 2]),
        # top_p 0.6: token 1 starts at mass 0.4 < 0.6 (kept), token 2 at 0.65 (dropped).
        (dict(top_p=0.6), [0, 1]),
        # min_p 0.45: tokens at least 0.45 times as likely as the top one (0.4): 0.2 stays, 0.1 goes.
        (dict(min_p=0.45), [0, 1, 2]),
        # top-k 2 renormalizes to 0.62, 0.38: top_p 0.7 keeps both, 0.6 only the first.
        (dict(top_k=2, top_p=0.7), [0, 1]),
        (dict(top_k=2, top_p=0.6), [0]),
        # top-k 4 (0.4, 0.25, 0.2, 0.1 -> /0.95): top_p 0.5 keeps 0.42 + the next one.
        (dict(top_k=4, top_p=0.5), [0, 1]),
        (dict(top_k=4, top_p=0.9, min_p=0.3), [0, 1, 2]),
    ],
)
def test_filters_restrict_the_support(filters, keep):
    torch.manual_seed(0)
    row = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05]).log()
    tokens = sample(row.expand(20_000, -1).contiguous(), **filters)
    observed = torch.bincount(tokens, minlength=5).double()
    probs = filtered_probs(row, keep)
    assert observed[probs == 0].sum() == 0
    assert chi_square(observed, probs) < CHI2_999[max(len(keep) - 1, 2)]


def test_filters_mix_with_unfiltered_rows():
    """Rows without top_k in a batch where others set it: each keeps its own filters."""
    torch.manual_seed(0)
    logits = torch.randn(2, 30)
    t = SamplingTensors(torch.ones(2), filters=(torch.tensor([1, 0]), torch.ones(2), torch.zeros(2)), max_top_k=1)
    tokens = torch.stack([Sampler()(logits, t)[0] for _ in range(200)])
    assert (tokens[:, 0] == logits[0].argmax()).all()
    assert tokens[:, 1].unique().numel() > 5


@pytest.mark.parametrize("k", [1, 7, 50])
@pytest.mark.parametrize("ties", [False, True])
def test_top_candidates_are_the_top_k(k, ties):
    """The two-stage selection returns topk's values (ties too: integer scores from a small
    range), each id pointing at its value, no id twice."""
    torch.manual_seed(k)
    vocab = 64 * 256
    scores = torch.randint(0, 40, (8, vocab)).float() if ties else torch.randn(8, vocab)
    width = chunk_width(vocab, k)
    assert width == 64
    values, ids = top_candidates(scores, k, width)
    assert torch.equal(values, scores.topk(k, dim=-1).values)
    assert torch.equal(scores.gather(1, ids), values)
    assert all(row.unique().numel() == k for row in ids)


@pytest.mark.parametrize("vocab", [151_936, 128_256, 1_024, 1_001, 40])
@pytest.mark.parametrize("ties", [False, True])
def test_row_argmax_is_argmax_first_on_ties(vocab, ties):
    """The two-pass argmax (chunk maxima, then the best chunk) equals argmax, the first of
    equal maxima included: scores from a small integer range tie within and across chunks."""
    torch.manual_seed(vocab)
    scores = torch.randint(0, 5, (6, vocab)).float() if ties else torch.randn(6, vocab)
    scores[0, -1] = scores[0].max() + 1  # the last token
    scores[1, :] = 0.0  # one value everywhere: token 0
    expected = torch.tensor([torch.nonzero(row == row.max())[0, 0] for row in scores])
    assert torch.equal(row_argmax(scores), expected)
    assert torch.equal(row_argmax(scores), scores.argmax(dim=-1))


def test_chunk_width_falls_back_to_a_plain_topk():
    assert chunk_width(151_936, 50) == 64  # Qwen's vocabulary
    assert chunk_width(128_256, 50) == 64  # Llama 3's
    assert chunk_width(1_001, 5) == 1  # odd: no chunk divides it
    assert chunk_width(1_024, 3) == 64
    assert chunk_width(1_024, 50) == 1  # too few chunks per candidate


def test_top_k_sampling_over_chunks_follows_the_filtered_softmax():
    """top_k 3 over a vocabulary the chunked selection splits: the three best tokens sit
    in different chunks, everything else is far below."""
    vocab, best = 1_024, [5, 700, 300]
    row = torch.full((vocab,), -8.0)
    row[best] = torch.tensor([1.0, 0.6, 0.2])
    row[6] = 0.1  # fourth best, in the first one's chunk: must never be drawn
    assert chunk_width(vocab, 3) > 1
    n = 20_000
    tokens = sample(row.expand(n, -1).contiguous(), 0.8, top_k=3, keys=torch.full((n,), 99), positions=torch.arange(n))
    observed = torch.bincount(tokens, minlength=vocab).double()
    probs = filtered_probs(row / 0.8, best)
    assert observed[probs == 0].sum() == 0
    assert chi_square(observed, probs) < CHI2_999[2]


@pytest.mark.parametrize("all_top_k", [True, False], ids=["top_k path", "sort-free path"])
def test_compiled_filtered_paths_equal_eager(all_top_k):
    """torch.compile (dynamic shapes) over a whole filtered path: the same tokens as eager
    for batch sizes and k that change between calls."""
    torch.manual_seed(0)
    vocab = 4_096
    set_compile_enabled(True)
    try:
        for batch, k in ((4, 3), (7, 5), (5, 9)):
            logits = torch.randn(batch, vocab) * 3
            top_k = torch.full((batch,), k) if all_top_k else torch.tensor([0, k] * batch)[:batch]
            t = SamplingTensors(torch.rand(batch) + 0.2, keys=torch.randint(0, 1 << 40, (batch,)),
                                positions=torch.randint(0, 100, (batch,)),
                                filters=(top_k, torch.full((batch,), 0.8), torch.full((batch,), 0.01)),
                                max_top_k=k, all_top_k=all_top_k)
            compiled = Sampler()(logits, t)[0]
            set_compile_enabled(False)
            try:
                assert torch.equal(compiled, Sampler()(logits, t)[0])
            finally:
                set_compile_enabled(True)
    finally:
        set_compile_enabled(False)


def test_after_warm_up_no_filtered_batch_compiles():
    """Sampler.warm_up (what a server runs at start-up) compiles two paths, top-k on every
    row and the sort-free filters, and leaves nothing for later batches to compile: other
    batch sizes, top_k values (1 and none too), penalties (float32 logits) or not (the
    model's bf16)."""
    from torch._dynamo.utils import counters

    vocab = 4_096
    torch._dynamo.reset()  # no graphs left from earlier tests: the count below is the warm-up's
    set_compile_enabled(True)
    try:
        sampler = Sampler()
        before = counters["stats"]["unique_graphs"]
        sampler.warm_up(vocab, torch.device("cpu"), torch.bfloat16)
        compiled = counters["stats"]["unique_graphs"]
        assert compiled - before == 2
        for batch, k in ((1, 5), (3, 9), (6, 3), (2, 1), (4, 0)):  # k: the largest top_k (0: top-p alone)
            ones = torch.ones(batch)
            keys = torch.arange(batch)
            counts = torch.zeros(batch + 2, vocab, dtype=torch.int32)
            penalties = Penalties(counts, counts > 0, keys + 2, ones * 1.2, ones * 0, ones * 0)
            filters = (torch.full((batch,), k), ones * 0.8, ones * 0)
            logits = torch.randn(batch, vocab, dtype=torch.bfloat16)
            for p in (None, penalties):
                for all_top_k in (True, False) if k else (False,):
                    sampler(logits, SamplingTensors(ones, keys, keys * 3, filters, k, all_top_k, p))
            sampler(logits, SamplingTensors(ones, keys, keys * 3, penalties=penalties))
        assert counters["stats"]["unique_graphs"] == compiled
    finally:
        set_compile_enabled(False)


@pytest.mark.parametrize("all_top_k", [True, False], ids=["top_k path", "sort-free path"])
def test_one_row_draws_what_it_draws_in_a_batch(all_top_k):
    """A batch of one runs the compiled paths as two copies of its row: its token is the
    one the same row (same key and position) gets inside a larger batch."""
    torch.manual_seed(1)
    vocab, batch = 1_000, 3
    logits = torch.randn(batch, vocab) * 2
    counts = torch.zeros(batch + 1, vocab, dtype=torch.int32)
    counts[1, :50] = 2
    ones = torch.ones(batch)
    for trial in range(20):
        keys, positions = torch.randint(0, 1 << 40, (batch,)), torch.full((batch,), trial)
        penalties = Penalties(counts, counts > 0, torch.tensor([1, 0, 2]), ones * 1.3, ones * 0.2, ones * 0.1)
        filters = (torch.full((batch,), 20), ones * 0.9, ones * 0.01)
        whole = Sampler()(logits, SamplingTensors(ones * 0.9, keys, positions, filters, 20, all_top_k, penalties))[0]
        one = Penalties(counts, counts > 0, torch.tensor([1]), ones[:1] * 1.3, ones[:1] * 0.2, ones[:1] * 0.1)
        alone = Sampler()(logits[:1], SamplingTensors(ones[:1] * 0.9, keys[:1], positions[:1],
                                                      tuple(f[:1] for f in filters), 20, all_top_k, one))[0]
        assert alone.shape == (1,) and alone[0] == whole[0]


def test_mixed_top_k_and_top_p_rows_over_a_large_vocabulary():
    """A batch where one row sets top_k and another only top_p takes the sort-free path:
    each row's draws follow its own filtered softmax."""
    vocab, n = 1_024, 4_000  # expected counts in the hundreds or more: the chi-square bound holds
    row = torch.full((vocab,), -12.0)
    best = [900, 3, 450, 77]
    row[best] = torch.tensor([0.4, 0.25, 0.2, 0.1]).log()
    logits = row.expand(2 * n, -1).contiguous()
    top_k = torch.tensor([2, 0]).repeat_interleave(n)
    top_p = torch.tensor([1.0, 0.6]).repeat_interleave(n)
    t = SamplingTensors(torch.ones(2 * n), keys=torch.full((2 * n,), 5), positions=torch.arange(2 * n),
                        filters=(top_k, top_p, torch.zeros(2 * n)), max_top_k=2, all_top_k=False)
    tokens = Sampler()(logits, t)[0]
    for half, keep in ((tokens[:n], best[:2]), (tokens[n:], best[:2])):  # top_k 2; top_p 0.6 keeps 0.4 + 0.25
        observed = torch.bincount(half, minlength=vocab).double()
        probs = filtered_probs(row, keep)
        assert observed[probs == 0].sum() == 0
        assert chi_square(observed, probs) < CHI2_999[2]


def test_top_p_threshold_search_keeps_the_nucleus():
    """Against the definition by sorting: a token stays iff the mass ranked before it is
    below top_p (random rows, several p; no two probabilities tie)."""
    torch.manual_seed(3)
    logits = torch.randn(64, 500) * 2
    for p in (0.3, 0.75, 0.95):
        t = SamplingTensors(torch.ones(64), keys=torch.arange(64), positions=torch.zeros(64, dtype=torch.int64),
                            filters=(torch.zeros(64, dtype=torch.int64), torch.full((64,), p), torch.zeros(64)))
        probs = logits.double().softmax(-1)
        sorted_probs, order = probs.sort(-1, descending=True)
        kept_sorted = (sorted_probs.cumsum(-1) - sorted_probs) < p
        allowed = torch.zeros_like(kept_sorted).scatter(1, order, kept_sorted)
        for position in range(20):  # 20 draws per row, all inside the nucleus
            t.positions = torch.full((64,), position)
            tokens = Sampler()(logits, t)[0]
            assert allowed.gather(1, tokens.unsqueeze(1)).all()


def penalties(counts: torch.Tensor, in_prompt: torch.Tensor, rep=1.0, freq=0.0, pres=0.0) -> Penalties:
    """Row i reads slot b - 1 - i of the tables (rows and slots need not line up)."""
    b = counts.size(0)
    rows = torch.arange(b - 1, -1, -1)
    return Penalties(counts.flip(0), in_prompt.flip(0), rows, torch.full((b,), rep), torch.full((b,), freq),
                     torch.full((b,), pres))


def test_repetition_penalty_equals_transformers():
    torch.manual_seed(0)
    logits = torch.randn(4, 40) * 3
    prompt = torch.randint(0, 40, (4, 6))
    output = torch.randint(0, 40, (4, 5))
    counts = torch.zeros(4, 40, dtype=torch.int32).scatter_add_(1, output, torch.ones_like(output, dtype=torch.int32))
    in_prompt = torch.zeros(4, 40, dtype=torch.bool).scatter_(1, prompt, True)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.cat([prompt, output], 1), logits.clone())
    t = SamplingTensors(torch.zeros(4), penalties=penalties(counts, in_prompt, rep=1.3), num_logprobs=0)
    # Greedy after the penalty picks the argmax of the penalized logits.
    tokens, _ = Sampler()(logits, t)
    assert torch.equal(tokens, expected.argmax(-1))
    torch.testing.assert_close(penalize(logits, t.penalties.as_tuple()), expected)


def test_frequency_and_presence_penalties_follow_openai():
    """logit[j] - count[j] * frequency - (count[j] > 0) * presence, on output tokens only."""
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    counts = torch.randint(0, 3, (3, 20), dtype=torch.int32)
    in_prompt = torch.rand(3, 20) < 0.3  # the prompt does not matter for these two
    got = penalize(logits, penalties(counts, in_prompt, freq=0.5, pres=-0.25).as_tuple())
    expected = logits.clone()
    for i in range(3):
        for j in range(20):
            c = counts[i, j].item()
            expected[i, j] -= c * 0.5 + (c > 0) * -0.25
    torch.testing.assert_close(got, expected)


def test_uniforms_stay_strictly_inside_the_unit_interval():
    """The extreme hashes map strictly inside (0, 1) in float32, so every Exp(1) draw is
    positive and finite (a draw of 0 would make its token win whatever its probability)."""
    uniform = open_unit_interval(torch.tensor([0, 1, (1 << 32) - 2, (1 << 32) - 1]))
    assert (uniform > 0).all() and (uniform < 1).all()
    draws = -uniform.log()
    assert (draws > 0).all() and torch.isfinite(draws).all()


def test_keyed_draws_depend_only_on_key_position_and_token():
    keys = torch.tensor([7, 7, 8, (1 << 61) + 3])
    positions = torch.tensor([10, 11, 10, 10])
    vocab = torch.arange(1000)
    draws = keyed_exponential(keys, positions, vocab)
    # The same (key, position) row computed alone, or through a subset of token ids.
    torch.testing.assert_close(keyed_exponential(keys[2:3], positions[2:3], vocab), draws[2:3])
    ids = torch.tensor([[5, 999, 0]])
    torch.testing.assert_close(keyed_exponential(keys[:1], positions[:1], ids), draws[:1, [5, 999, 0]])
    # Different key or position: different draws; all positive and Exp(1)-like.
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert (draws > 0).all()
    assert abs(draws.mean().item() - 1.0) < 0.05


def test_seeded_sampling_matches_the_distribution():
    """Keyed draws over many keys sample softmax(logits) like the generator does."""
    n = 40_000
    row = torch.tensor([1.0, 0.5, 0.0, -1.0, 2.0])
    keys = torch.arange(n, dtype=torch.int64) * 7919
    tokens = sample(row.expand(n, -1).contiguous(), 1.0, keys=keys, positions=torch.full((n,), 3))
    observed = torch.bincount(tokens, minlength=5).double()
    assert chi_square(observed, torch.softmax(row.double(), -1)) < CHI2_999[4]
    filtered = sample(row.expand(n, -1).contiguous(), 1.0, keys=keys, positions=torch.full((n,), 3), top_k=3)
    observed = torch.bincount(filtered, minlength=5).double()
    assert chi_square(observed, filtered_probs(row, [4, 0, 1])) < CHI2_999[2]


def test_logprobs_are_the_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    t = SamplingTensors(torch.full((5,), 0.5), num_logprobs=3,
                        penalties=penalties(torch.ones(5, 30, dtype=torch.int32), torch.ones(5, 30, dtype=torch.bool), rep=2.0))
    tokens, lp = Sampler()(logits, t)
    expected = logits.log_softmax(-1)
    torch.testing.assert_close(lp.chosen, expected.gather(1, tokens[:, None]).squeeze(1))
    values, ids = expected.topk(3, dim=-1)
    assert torch.equal(lp.top_ids, ids)
    torch.testing.assert_close(lp.top_values, values)
    assert torch.equal(lp.rank, (expected > lp.chosen[:, None]).sum(-1) + 1)


def test_banned_tokens_are_never_drawn():
    torch.manual_seed(0)
    logits = torch.zeros(2, 4)
    logits[:, 3] = 10.0  # token 3 would win almost always
    bans = (MinTokensProcessor(frozenset({3}), torch.device("cpu")), torch.tensor([[0, 1], [3, 3]]))
    t = SamplingTensors(torch.tensor([0.0, 1.0]), logits_processors=(bans,))
    for _ in range(50):
        assert (Sampler()(logits, t)[0] != 3).all()
