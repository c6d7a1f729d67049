"""Command-line flags made from the engine's arguments (nanovllm.config.Config), shared by
the nanovllm command and the benchmarks."""
from __future__ import annotations

import argparse
import dataclasses

from nanovllm.config import ATTENTION_BACKENDS, DEVICES, DTYPES, LOAD_FORMATS, SCHEDULING_POLICIES, Config

CHOICES = {
    "device": DEVICES,
    "dtype": ("auto", *DTYPES),
    "load_format": LOAD_FORMATS,
    "attention_backend": ATTENTION_BACKENDS,
    "scheduling_policy": SCHEDULING_POLICIES,
}


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.init and f.name != "model"]


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per engine argument (and vLLM's aliases: -tp, --block-size); unset flags
    keep Config's defaults."""
    group = parser.add_argument_group("engine arguments")
    group.add_argument("--model", help="local Hugging Face checkpoint folder (default: the bundled demo model)")
    for f in engine_fields():
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())]
        help_text = f.metadata.get("help", "")
        # The default in words, unless the help says it already (its own "default:", or "None:" for a None default).
        if "default:" not in help_text and not (f.default is None and "None:" in help_text):
            help_text = f"{help_text} (default: {f.default})".strip()
        # An unset flag is left out of the namespace (SUPPRESS), so that a flag may set None (--seed none).
        if isinstance(f.default, bool):
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        else:
            kind = f.metadata.get("type") or (str if f.default is None else type(f.default))
            group.add_argument(*flags, type=kind, choices=CHOICES.get(f.name), default=argparse.SUPPRESS,
                               help=help_text)


def engine_arguments(args: argparse.Namespace) -> dict:
    """The engine flags that were set."""
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}
