"""The bundled demo models: Qwen3s trained on the standard library's Python source.

They ship inside the package so that nanovllm runs with no download: the target
(nanovllm/demo/model/, ~17M parameters in bf16) is every command's default model, and the
draft (nanovllm/demo/draft/, ~5x smaller, the same tokenizer and chat template) drafts for
it in speculative decoding by a draft model, or serves as a second model.
`scripts/train_demo_model.py` rebuilds both. Their greedy output continues Python code;
they know nothing else.
"""
import os
from pathlib import Path

DEMO_MODEL_DIR: str = str(Path(__file__).resolve().parent / "model")
DEMO_DRAFT_MODEL_DIR: str = str(Path(__file__).resolve().parent / "draft")

# The tokenizer's files, the same in both folders (the benchmarks' dummy checkpoints borrow them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# What each checkpoint folder needs for LLM(...) to load it.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_path(draft: bool = False) -> str:
    """DEMO_MODEL_DIR (or, with draft=True, DEMO_DRAFT_MODEL_DIR), after checking that the
    model files are there.

    Raises:
        FileNotFoundError: a file is missing (an install without package data, or a
            checkout where the model was deleted); the message says how to rebuild it.
    """
    folder = DEMO_DRAFT_MODEL_DIR if draft else DEMO_MODEL_DIR
    missing = [name for name in REQUIRED_FILES if not (Path(folder) / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the bundled demo model is incomplete: {', '.join(missing)} missing from {folder}. "
            "Reinstall nanovllm (the files ship as package data), or rebuild them from a source "
            "checkout with `python scripts/train_demo_model.py --device cuda` (a few minutes on one GPU)."
        )
    return folder


def model_name(folder: str) -> str:
    """A model folder's default name (the server's served model name): "demo" and
    "demo-draft" for the bundled models however their folder is given, else its last part."""
    real = os.path.realpath(folder)
    names = {os.path.realpath(DEMO_MODEL_DIR): "demo", os.path.realpath(DEMO_DRAFT_MODEL_DIR): "demo-draft"}
    return names.get(real, os.path.basename(os.path.normpath(folder)))
