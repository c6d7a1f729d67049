"""The bundled demo model: a ~4M-parameter Qwen3 trained on the standard library's Python.

It ships inside the package (nanovllm/demo/model/, ~17 MB) so that nanovllm runs with no
download. `scripts/train_demo_model.py` rebuilds it. Its greedy output continues Python
code; it knows nothing else.
"""
from pathlib import Path

DEMO_MODEL_DIR: str = str(Path(__file__).resolve().parent / "model")

# The tokenizer's files (the benchmarks' dummy checkpoints borrow them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# What a checkpoint folder needs for LLM(DEMO_MODEL_DIR) to load it.
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def demo_model_path() -> str:
    """DEMO_MODEL_DIR, after checking that the model files are there.

    Raises:
        FileNotFoundError: a file is missing (an install without package data, or a
            checkout where the model was deleted); the message says how to rebuild it.
    """
    missing = [name for name in REQUIRED_FILES if not (Path(DEMO_MODEL_DIR) / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the bundled demo model is incomplete: {', '.join(missing)} missing from {DEMO_MODEL_DIR}. "
            "Reinstall nanovllm (the files ship as package data), or rebuild them from a source "
            "checkout with `python scripts/train_demo_model.py` (~10 minutes on CPU)."
        )
    return DEMO_MODEL_DIR
