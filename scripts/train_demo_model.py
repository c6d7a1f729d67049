"""Train the bundled demo model: a tiny Qwen3 that writes Python, from the standard library.

The corpus is the .py source of the running interpreter's standard library, which every
machine with Python has offline. A byte-level BPE tokenizer and a ~4M-parameter Qwen3 are
trained on it from scratch, seeded, in about 8-10 minutes on 2 CPU cores, and written as a
Hugging Face checkpoint (config.json, model.safetensors, generation_config.json, tokenizer
files with a ChatML chat template) that nanovllm loads like any other.

    python scripts/train_demo_model.py              # writes nanovllm/demo/model/
    python scripts/train_demo_model.py --out /tmp/demo --steps 50   # a quick smoke run

The same seed on the same Python version gives the same corpus, tokenizer and loss curve
(up to CPU floating-point nondeterminism).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sysconfig
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning. On a shared machine where another job holds
# a core, spinning threads made each step ~15x slower (7 s instead of 0.5 s).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # after the OpenMP setting, which is read when torch loads
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from nanovllm.testing.checkpoints import CHAT_TEMPLATE, EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, SPECIAL_TOKENS

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "nanovllm" / "demo" / "model"

# Standard-library folders left out of the corpus: tests (odd code, huge), vendored
# packages, and generated tables (codec maps, pydoc's topic text) that are data, not code.
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"}
# ~8 MB of source is ~2.2M tokens: about one pass (1000 x 8 x 256 = 2.0M) in the default run.
CORPUS_CHARS = 8_000_000
# Files at the end of the shuffled list held out to report a validation loss.
VAL_CHARS = 300_000

# Model shape. 4 x 256 with tied embeddings is ~4.2M parameters: 17 MB in float32, within
# the 20 MB budget, and ~4k training tokens/s on 2 cores. head_dim 64 is a power of two
# that the Triton kernels accept; 4 query heads and 2 KV heads split over tensor parallel 2.
VOCAB_SIZE = 4096
HIDDEN_SIZE = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE_SIZE = 768
# Trained on CONTEXT_LEN windows; RoPE stretches somewhat beyond, so chats get more room.
MAX_POSITION_EMBEDDINGS = 1024
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6

# Optimiser: AdamW with linear warm-up then cosine decay to MIN_LR_RATIO of the peak.
CONTEXT_LEN = 256
BATCH_SIZE = 8
STEPS = 1000
PEAK_LR = 2e-3
WARMUP_STEPS = 50
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
LOG_EVERY = 25
EVAL_EVERY = 250
EVAL_BATCHES = 8

SAMPLE_PROMPTS = ["def fibonacci(", "import os\n", "class Stack:\n    def __init__(self"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file shuffle, the init and the batches")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimiser steps (default: {STEPS})")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"windows per step (default: {BATCH_SIZE})")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    return parser.parse_args()


def stdlib_sources(seed: int) -> tuple[list[str], list[str]]:
    """The standard library's .py files as (train, val) text lists.

    Files are listed in sorted order, shuffled with `seed`, and taken until CORPUS_CHARS
    (train) plus VAL_CHARS (val) characters are collected.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    random.Random(seed).shuffle(paths)
    train: list[str] = []
    val: list[str] = []
    train_chars = val_chars = 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if train_chars < CORPUS_CHARS:
            train.append(text)
            train_chars += len(text)
        elif val_chars < VAL_CHARS:
            val.append(text)
            val_chars += len(text)
        else:
            break
    if not train or not val:
        raise RuntimeError(f"found too little Python source under {root} to train on")
    return train, val


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with VOCAB_SIZE entries; ids 0, 1, 2 are the special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
    )


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All files as one token stream, each followed by <|endoftext|>. # [num_tokens]"""
    ids: list[int] = []
    for encoded in tokenizer(texts)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(tokenizer: PreTrainedTokenizerFast) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=len(tokenizer),
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def random_windows(tokens: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` random CONTEXT_LEN windows of the stream. # [batch_size, CONTEXT_LEN]"""
    starts = torch.randint(0, len(tokens) - CONTEXT_LEN, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + CONTEXT_LEN] for s in starts.tolist()])


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
    return PEAK_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def val_loss(model: Qwen3ForCausalLM, val_tokens: torch.Tensor, batch_size: int) -> float:
    """Mean loss over EVAL_BATCHES fixed, non-overlapping windows of the held-out files."""
    model.eval()
    windows = val_tokens[: EVAL_BATCHES * batch_size * CONTEXT_LEN].view(-1, CONTEXT_LEN)
    losses = [model(input_ids=batch, labels=batch).loss.item() for batch in windows.split(batch_size)]
    model.train()
    return sum(losses) / len(losses)


def train(model: Qwen3ForCausalLM, train_tokens: torch.Tensor, val_tokens: torch.Tensor, args: argparse.Namespace) -> float:
    """Run args.steps AdamW steps; returns the mean training loss of the last LOG_EVERY steps."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=PEAK_LR, betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(args.seed)
    model.train()
    recent: list[float] = []
    start = time.perf_counter()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps)
        batch = random_windows(train_tokens, args.batch_size, generator)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        done = step + 1
        if done % LOG_EVERY == 0 or done == args.steps:
            elapsed = time.perf_counter() - start
            print(f"step {done:5d}/{args.steps}  loss {sum(recent) / len(recent):.4f}  "
                  f"lr {lr_at(step, args.steps):.2e}  {elapsed:6.0f} s", flush=True)
        if done % EVAL_EVERY == 0 or done == args.steps:
            print(f"step {done:5d}/{args.steps}  val loss {val_loss(model, val_tokens, args.batch_size):.4f}", flush=True)
    return sum(recent) / len(recent)


@torch.no_grad()
def print_samples(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    model.eval()
    for prompt in SAMPLE_PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt)])
        output = model.generate(input_ids, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        print(f"--- {prompt!r}\n{tokenizer.decode(output[0])}", flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    train_texts, val_texts = stdlib_sources(args.seed)
    print(f"corpus: {len(train_texts)} train files ({sum(map(len, train_texts)) / 1e6:.1f} M chars), "
          f"{len(val_texts)} val files, from {sysconfig.get_paths()['stdlib']}", flush=True)
    tokenizer = train_tokenizer(train_texts)
    train_tokens = encode_corpus(tokenizer, train_texts)
    val_tokens = encode_corpus(tokenizer, val_texts)
    print(f"tokenizer: vocab {len(tokenizer)}; {len(train_tokens) / 1e6:.2f} M train tokens, "
          f"{len(val_tokens) / 1e6:.2f} M val tokens ({time.perf_counter() - start:.0f} s)", flush=True)

    model = build_model(tokenizer)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3 {NUM_LAYERS} layers x {HIDDEN_SIZE}, {num_params / 1e6:.2f} M parameters; "
          f"{args.steps} steps of {args.batch_size} x {CONTEXT_LEN} tokens", flush=True)
    final_loss = train(model, train_tokens, val_tokens, args)

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # save_pretrained writes the weights owner-only (0600); installed package data must be world-readable.
    (args.out / "model.safetensors").chmod(0o644)
    size_mb = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file()) / 1e6
    print(f"final train loss {final_loss:.4f}; wrote {args.out} ({size_mb:.1f} MB) "
          f"in {time.perf_counter() - start:.0f} s", flush=True)
    print_samples(model, tokenizer)


if __name__ == "__main__":
    main()
