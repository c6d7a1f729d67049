"""The tokenizer of a checkpoint folder, and its end-of-sequence ids."""
from __future__ import annotations

import json
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# A folder holds a usable tokenizer when it has one of these (fast, SentencePiece, or
# the vocabulary files of a slow BPE / WordPiece tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `path`. Without tokenizer files transformers would build
    an empty one that turns every text into no tokens: refuse that at start-up."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                         f"copy them from the model's release into that folder")
    return AutoTokenizer.from_pretrained(path)


def load_eos_token_ids(model_path: str, tokenizer: PreTrainedTokenizerBase, hf_config) -> set[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id (an int or a list),
    else config.json's, plus the tokenizer's."""
    ids: set[int] = set()
    path = os.path.join(model_path, "generation_config.json")
    value = None
    if os.path.isfile(path):
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    if value is not None:
        ids.update(value if isinstance(value, list) else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
