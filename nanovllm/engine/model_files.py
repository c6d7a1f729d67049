"""What the engine reads from a checkpoint folder besides its weights: the tokenizer, the
end-of-sequence ids and the default sampling parameters (generation_config.json)."""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils import is_int

logger = logging.getLogger(__name__)

# A folder holds a usable tokenizer when it has one of these (fast, SentencePiece, or
# the vocabulary files of a slow BPE / WordPiece tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


# generation_config.json's fields that become default sampling parameters, as vLLM reads
# them: generation_config name -> SamplingParams name. The server takes max_new_tokens as a
# cap on every request's max_tokens, as vLLM's does.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def check_tokenizer_files(config: Config) -> None:
    """Without tokenizer files transformers would build an empty tokenizer that turns every
    text into no tokens: refuse that at start-up."""
    path = config.tokenizer_path
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{path!r} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); "
                         f"copy them from the model's release into that folder")


def load_tokenizer(config: Config) -> PreTrainedTokenizerBase:
    """The tokenizer of config.tokenizer (default: the model's folder)."""
    # Imported here: AutoTokenizer pulls in transformers' generation code (seconds of
    # imports), which a server's engine process does without.
    from transformers import AutoTokenizer

    check_tokenizer_files(config)
    return AutoTokenizer.from_pretrained(config.tokenizer_path, trust_remote_code=config.trust_remote_code)


def load_generation_defaults(config: Config) -> dict[str, Any]:
    """The sampling parameters the checkpoint recommends (generation_config.json), which a
    request's unset fields take, as in vLLM: the request's own value, else these, else
    SamplingParams' defaults. generation_config="vllm" skips them."""
    if config.generation_config == "vllm":
        return {}
    values = _generation_config(config)
    defaults = {ours: values[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if values.get(theirs) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:  # at start-up, not in the first request that takes them
        raise ValueError(f"{_generation_config_path(config)}: {exc}") from None
    return defaults


def _generation_config(config: Config) -> dict[str, Any]:
    """generation_config.json's values, from the folder config.generation_config names (the
    model's for "auto" and "vllm"); {} where there is no such file."""
    path = _generation_config_path(config)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


def _generation_config_path(config: Config) -> str:
    folder = config.model if config.generation_config in ("auto", "vllm") else config.generation_config
    return os.path.join(folder, "generation_config.json")


def load_eos_token_ids(config: Config, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """End-of-sequence ids: generation_config.json's eos_token_id (an int or a list; from
    the folder config.generation_config names, the model's for "vllm" too, as vLLM's: that
    value turns off the sampling defaults alone), else config.json's, plus the tokenizer's."""
    ids: set[int] = set()
    value, source = _generation_config(config).get("eos_token_id"), _generation_config_path(config)
    if value is None:
        value, source = getattr(config.hf_config, "eos_token_id", None), os.path.join(config.model, "config.json")
    if value is not None:
        values = value if isinstance(value, list) else [value]
        if not all(is_int(t) and t >= 0 for t in values):
            raise ValueError(f"{source}: eos_token_id must be a token id or a list of them (ints >= 0), "
                             f"got {value!r}")
        if past := [t for t in values if t >= config.hf_config.vocab_size]:  # never sampled: no end, no error
            logger.warning("%s: eos_token_id %s past the model's vocabulary (%d) left out", source, past,
                           config.hf_config.vocab_size)
        ids.update(t for t in values if t < config.hf_config.vocab_size)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
