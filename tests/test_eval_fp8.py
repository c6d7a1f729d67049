"""benchmarks/eval_fp8.py: the engine scores held-out text as transformers does, and every
FP8 mode stays within the issue's 2% of the unquantized perplexity (RESULTS.md has the
figures over every held-out file)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from nanovllm import LLM
from nanovllm.demo import DEMO_MODEL_DIR
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def eval_fp8():
    return load_benchmark("eval_fp8")


def test_window_loss_equals_transformers(eval_fp8):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ids = [tokenizer.eos_token_id] + tokenizer.encode("import os\n\n\ndef walk(top):\n    for name in os.listdir(top):\n")
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    expected = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="sum").item()
    with LLM(DEMO_MODEL_DIR, device="cpu", dtype="float32", enforce_eager=True) as llm:
        assert eval_fp8.window_nats(llm, ids) == pytest.approx(expected, rel=1e-5)


def test_decode_steps_score_as_the_prefill_does(eval_fp8):
    """--decode: two windows teacher-forced through decode steps give the prefill's logits."""
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    windows = [[tokenizer.eos_token_id] + tokenizer.encode(text)[:12] for text in ("import os\n\n\ndef walk(top):\n"
               "    for name in os.listdir(top):\n", "class Stack:\n    def __init__(self):\n        self.items = []\n")]
    with LLM(DEMO_MODEL_DIR, device="cpu", dtype="float32", enforce_eager=True) as llm:
        [batch] = eval_fp8.window_batches(llm, windows, decode=True)
        decoded = eval_fp8.decoded_logits(llm, batch)
        for window, logits in zip(batch, decoded, strict=True):
            torch.testing.assert_close(logits, eval_fp8.window_logits(llm, window)[:-1], rtol=1e-4, atol=1e-4)


def test_every_fp8_mode_within_two_percent(eval_fp8, capsys):
    eval_fp8.main(["--dtype", "float32", "--max-files", "1", "--max-chars", "1500", "--json"])
    results = json.loads(capsys.readouterr().out)
    assert set(results) == set(eval_fp8.MODES)
    for mode, result in results.items():
        assert abs(result["vs_unquantized"]) < 0.02, mode
        assert result["argmax_agreement"] > 0.9, mode  # 95-97% over every held-out file (RESULTS.md)
