"""Train the bundled demo models: a Qwen3 target and a ~5x smaller draft that write Python.

The corpus is the .py source of the running interpreter's standard library, which every
machine with Python has offline (nanovllm.demo.corpus; its held-out modules are never read
for training). One byte-level BPE tokenizer is trained on it, then the target and the draft
one after the other, in bf16 mixed precision with AdamW, a linear warm-up and a cosine
decay; each is written with save_pretrained as a Hugging Face Qwen3 checkpoint in bf16
(config.json, model.safetensors, generation_config.json, and the same tokenizer files with
a ChatML chat template in both folders) that nanovllm loads like any other.

    python scripts/train_demo_model.py --device cuda            # writes nanovllm/demo/{model,draft}/
    python scripts/train_demo_model.py --smoke --out /tmp/demo   # tiny settings on CPU, seconds

Each model trains for EPOCHS passes over the corpus, or fewer when its step rate, timed over
its first steps, would overrun its time budget; the step count it prints repeats the run
with --steps. The same seed on the same Python gives the same corpus, tokenizer, init and
batches (the loss curve up to floating-point nondeterminism).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning. On a shared machine where another job holds
# a core, spinning threads made each CPU step ~15x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # after the OpenMP setting, which is read when torch loads
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from nanovllm.demo.corpus import held_out_sources, read_source, stdlib_root, training_files
from nanovllm.testing.checkpoints import CHAT_TEMPLATE, EOS_TOKEN, IM_END_TOKEN, IM_START_TOKEN, SPECIAL_TOKENS

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "nanovllm" / "demo"

# 8k merges: Python's keywords, common identifiers and indentation runs get their own
# tokens, and the tied embedding stays a small share of the draft.
VOCAB_SIZE = 8192
# Trained on full-length windows, so the whole context is usable.
CONTEXT_LEN = 1024
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6
# A power of two that the Triton kernels accept, in both models.
HEAD_DIM = 64
# Share of the (shuffled) training files kept back to pick each model's best checkpoint.
VAL_SHARE = 0.02


@dataclass(frozen=True)
class ModelSpec:
    folder: str  # under --out
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    peak_lr: float
    dropout: float  # on the embeddings and each residual branch: the corpus is a few MB
    time_budget_s: float  # training steps are cut to fit this at the measured step rate


# ~17M parameters (34 MB in bf16) and ~3.3M (6.6 MB): within the 48 MB that the package
# ships. Query and KV head counts are even, so both split over tensor parallel 2.
TARGET = ModelSpec("model", hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, intermediate_size=1152,
                   peak_lr=1.5e-3, dropout=0.1, time_budget_s=210)
DRAFT = ModelSpec("draft", hidden_size=192, num_layers=4, num_heads=2, num_kv_heads=2, intermediate_size=576,
                  peak_lr=3e-3, dropout=0.0, time_budget_s=75)
SPECS = {"target": TARGET, "draft": DRAFT}

# Optimiser: AdamW, linear warm-up then cosine decay to MIN_LR_RATIO of the peak.
EPOCHS = 40
BATCH_SIZE = 32
WARMUP_STEPS = 100
MIN_LR_RATIO = 0.1
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
# The step rate is timed over steps RATE_FROM..RATE_TO: after the first steps' kernel
# selection, and inside the warm-up, so cutting the step count leaves the steps run so far
# on the schedule they would have had anyway.
RATE_FROM, RATE_TO = 10, 30
LOG_EVERY = 100
EVAL_EVERY = 100
# --smoke: a slice of the corpus, short windows, a few steps; for checking the script on CPU.
SMOKE_MAX_CHARS = 300_000
SMOKE_SETTINGS = dict(steps=3, batch_size=2, context_len=128)

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def __init__(self"]


@dataclass(slots=True)
class TrainResult:
    steps: int
    tokens_seen: int
    train_s: float
    running_train_loss: float  # mean over the last LOG_EVERY steps, in train mode
    best_val_loss: float
    best_step: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"parent of the model folders (default: {DEFAULT_OUT})")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--models", nargs="+", choices=tuple(SPECS), default=list(SPECS), help="which to train")
    parser.add_argument("--seed", type=int, default=0, help="seed of the file shuffle, the inits and the batches")
    parser.add_argument("--steps", type=int, help=f"optimiser steps per model (default: {EPOCHS} epochs or the time budget)")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help=f"windows per step (default: {BATCH_SIZE})")
    parser.add_argument("--context-len", type=int, default=CONTEXT_LEN, help=f"tokens per window (default: {CONTEXT_LEN})")
    parser.add_argument("--max-chars", type=int, help="read at most this many characters of source (default: all)")
    parser.add_argument("--smoke", action="store_true", help="tiny settings (a corpus slice, a few short steps)")
    args = parser.parse_args()
    if args.smoke:
        args.max_chars = args.max_chars or SMOKE_MAX_CHARS
        for name, value in SMOKE_SETTINGS.items():
            if getattr(args, name) in (None, parser.get_default(name)):
                setattr(args, name, value)
    return args


def first_chars(texts: list[str], limit: float) -> list[str]:
    """The leading texts that reach `limit` characters (at least one)."""
    count, chars = 0, 0
    while count < len(texts) and (count == 0 or chars < limit):
        chars += len(texts[count])
        count += 1
    return texts[:count]


def load_corpus(seed: int, max_chars: int | None) -> tuple[list[str], list[str], list[str]]:
    """(train, val, held-out) source texts. Training files are shuffled with `seed`; the
    first VAL_SHARE of their characters become the validation set. With max_chars, the
    corpus is that many characters, and the held-out set a VAL_SHARE of them."""
    files = training_files()
    random.Random(seed).shuffle(files)
    texts = [text for text in map(read_source, files) if text is not None]
    if max_chars is not None:
        texts = first_chars(texts, max_chars)
    val = first_chars(texts, VAL_SHARE * sum(map(len, texts)))
    train = texts[len(val):]
    held_out = list(held_out_sources().values())
    if max_chars is not None:
        held_out = first_chars(held_out, VAL_SHARE * max_chars)
    if not train or not held_out:
        raise RuntimeError(f"found too little Python source under {stdlib_root()} to train on")
    return train, val, held_out


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


def encode_corpus(tokenizer: PreTrainedTokenizerFast, texts: list[str], device: torch.device) -> torch.Tensor:
    """All files as one token stream, each followed by <|endoftext|>. # [num_tokens]"""
    ids: list[int] = []
    for encoded in tokenizer(texts)["input_ids"]:
        ids.extend(encoded)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long, device=device)


def build_model(spec: ModelSpec, tokenizer: PreTrainedTokenizerFast, context_len: int) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=len(tokenizer) + len(tokenizer) % 2,  # even, for tensor parallel 2
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=context_len,
        rms_norm_eps=RMS_NORM_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Qwen3ForCausalLM(config)


def add_dropout(model: Qwen3ForCausalLM, p: float) -> None:
    """Dropout on the token embeddings and on each residual branch's output (attention's
    o_proj, the MLP's down_proj), where GPT-2 has it; only in train mode. Forward hooks, so
    the saved checkpoint stays a plain Qwen3."""
    if p == 0:
        return

    def drop(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return F.dropout(output, p, module.training)

    model.model.embed_tokens.register_forward_hook(drop)
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(drop)
        layer.mlp.down_proj.register_forward_hook(drop)


def random_windows(tokens: torch.Tensor, batch_size: int, context_len: int, generator: torch.Generator) -> torch.Tensor:
    """`batch_size` random windows of the stream. # [batch_size, context_len]"""
    # Drawn where the tokens are: a copy from the host would make every step wait for the last.
    starts = torch.randint(0, len(tokens) - context_len, (batch_size, 1), generator=generator, device=tokens.device)
    return tokens[starts + torch.arange(context_len, device=tokens.device)]


def lr_at(step: int, steps: int, peak_lr: float) -> float:
    if step < WARMUP_STEPS:
        return peak_lr * (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS))
    return peak_lr * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device) -> torch.autocast:
    """bf16 mixed precision on the GPU (float32 master weights); plain float32 on CPU."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def mean_loss(model: Qwen3ForCausalLM, tokens: torch.Tensor, batch_size: int, context_len: int) -> float:
    """Mean next-token loss (nats) over consecutive, non-overlapping windows of the stream."""
    was_training = model.training
    model.eval()
    windows = tokens[: len(tokens) // context_len * context_len].view(-1, context_len)
    if len(windows) == 0:
        windows = tokens.view(1, -1)
    total = 0.0
    with autocast(tokens.device):
        for batch in windows.split(batch_size):
            total += model(input_ids=batch, labels=batch, use_cache=False).loss.item() * len(batch)
    model.train(was_training)
    return total / len(windows)


def train(model: Qwen3ForCausalLM, spec: ModelSpec, train_tokens: torch.Tensor, val_tokens: torch.Tensor,
          args: argparse.Namespace) -> TrainResult:
    """AdamW over random windows; returns at the end with the weights of the best validation loss."""
    device = train_tokens.device
    tokens_per_step = args.batch_size * args.context_len
    steps = args.steps or max(1, EPOCHS * len(train_tokens) // tokens_per_step)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.peak_lr, betas=BETAS, fused=device.type == "cuda",
    )
    generator = torch.Generator(device).manual_seed(args.seed)
    best_val, best_step, best_state = math.inf, 0, None
    loss_sum = torch.zeros((), device=device)  # summed on the device: no sync per step
    losses_summed = 0
    running = math.nan
    model.train()
    start = time.perf_counter()
    step = 0
    while step < steps:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, spec.peak_lr)
        batch = random_windows(train_tokens, args.batch_size, args.context_len, generator)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        losses_summed += 1
        step += 1
        if args.steps is None and step in (RATE_FROM, RATE_TO):
            synchronize(device)
            now = time.perf_counter()
            if step == RATE_FROM:
                rate_start = now
            else:
                rate = (RATE_TO - RATE_FROM) / (now - rate_start)
                fitting = step + int((spec.time_budget_s - (now - start)) * rate)
                print(f"  {rate * tokens_per_step:,.0f} tokens/s: {max(step, min(steps, fitting))} steps "
                      f"({steps} for {EPOCHS} epochs, {fitting} fit {spec.time_budget_s:.0f} s)", flush=True)
                steps = max(step, min(steps, fitting))
        if step % LOG_EVERY == 0 or step == steps:
            running = loss_sum.item() / losses_summed
            loss_sum.zero_()
            losses_summed = 0
            elapsed = time.perf_counter() - start
            print(f"  step {step:5d}/{steps}  loss {running:.4f}  lr {lr_at(step - 1, steps, spec.peak_lr):.2e}  "
                  f"{elapsed:5.0f} s  {step * tokens_per_step / elapsed:,.0f} tokens/s", flush=True)
        if step % EVAL_EVERY == 0 or step == steps:
            val = mean_loss(model, val_tokens, args.batch_size, args.context_len)
            if val < best_val:
                best_val, best_step = val, step
                best_state = {name: t.detach().clone() for name, t in model.state_dict().items()}
            print(f"  step {step:5d}/{steps}  val loss {val:.4f}  (best {best_val:.4f} at {best_step})", flush=True)
    synchronize(device)
    train_s = time.perf_counter() - start
    model.load_state_dict(best_state)
    return TrainResult(steps, steps * tokens_per_step, train_s, running, best_val, best_step)


def save(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> float:
    """Write the checkpoint (bf16) and the tokenizer; returns the folder's size in MB."""
    folder.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # save_pretrained writes the weights owner-only (0600); installed package data must be world-readable.
    (folder / "model.safetensors").chmod(0o644)
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file()) / 1e6


@torch.no_grad()
def print_samples(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    model.eval()
    device = next(model.parameters()).device
    for prompt in SAMPLE_PROMPTS:
        input_ids = torch.tensor([tokenizer.encode(prompt)], device=device)
        output = model.generate(input_ids, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        print(f"--- {prompt!r}\n{tokenizer.decode(output[0])}", flush=True)


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    torch.set_float32_matmul_precision("high")
    start = time.perf_counter()
    train_texts, val_texts, held_texts = load_corpus(args.seed, args.max_chars)
    print(f"corpus: {len(train_texts)} train files ({sum(map(len, train_texts)) / 1e6:.2f} M chars), "
          f"{len(val_texts)} val, {len(held_texts)} held-out, from Python {stdlib_root()}; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    tokenizer = train_tokenizer(train_texts)
    train_tokens, val_tokens, held_tokens = (encode_corpus(tokenizer, texts, device)
                                             for texts in (train_texts, val_texts, held_texts))
    held_bytes = sum(len(text.encode("utf-8")) for text in held_texts)
    print(f"tokenizer: vocab {len(tokenizer)}; {len(train_tokens) / 1e6:.2f} M train tokens "
          f"({sum(map(len, train_texts)) / len(train_tokens):.2f} chars/token), {len(val_tokens):,} val, "
          f"{len(held_tokens):,} held-out ({time.perf_counter() - start:.0f} s)", flush=True)

    summary = []
    for name in args.models:
        spec = SPECS[name]
        torch.manual_seed(args.seed)
        model = build_model(spec, tokenizer, args.context_len).to(device)
        add_dropout(model, spec.dropout)
        params = sum(p.numel() for p in model.parameters())
        print(f"{name}: Qwen3 {spec.num_layers} layers x {spec.hidden_size}, {params / 1e6:.2f} M parameters, "
              f"windows of {args.batch_size} x {args.context_len} tokens", flush=True)
        result = train(model, spec, train_tokens, val_tokens, args)
        model.to(torch.bfloat16)  # measured as shipped
        train_eval = mean_loss(model, train_tokens[: max(len(val_tokens), args.context_len)], args.batch_size,
                               args.context_len)
        held = mean_loss(model, held_tokens, args.batch_size, args.context_len)
        bits_per_byte = held * len(held_tokens) / held_bytes / math.log(2)
        size_mb = save(model, tokenizer, args.out / spec.folder)
        summary.append(f"{name}: {params / 1e6:.2f} M params, {result.steps} steps, "
                       f"{result.tokens_seen / 1e6:.1f} M tokens seen ({result.tokens_seen / len(train_tokens):.1f} "
                       f"epochs) in {result.train_s:.0f} s = {result.tokens_seen / result.train_s:,.0f} tokens/s; "
                       f"train loss {result.running_train_loss:.4f} (running), {train_eval:.4f} (eval); "
                       f"val {result.best_val_loss:.4f} (best, step {result.best_step}); held-out {held:.4f} "
                       f"nats/token, ~{bits_per_byte:.3f} bits/byte; {size_mb:.1f} MB")
        print(summary[-1], flush=True)
        print_samples(model, tokenizer)
        del model
    print(f"done in {time.perf_counter() - start:.0f} s; wrote {args.out}", flush=True)
    for line in summary:
        print("RESULT " + line, flush=True)


if __name__ == "__main__":
    main()
