"""The API process's tokenizer threads: tokenizing and rendering chat templates run off the
event loop, so that no prompt holds up /health or the streams being answered.

Two lanes, each one thread with a tokenizer of its own (a fast tokenizer shared between
threads can refuse a concurrent call): texts of LONG_TEXT_CHARS characters or more go to
the second, so a prompt of megabytes (one that truncate_prompt_tokens cuts, say) holds
up only other such prompts, never the short ones most requests carry.
"""
from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor

from nanovllm.engine.request import RequestChecker
from nanovllm.entrypoints.openai.chat import ChatRenderer

logger = logging.getLogger(__name__)
LONG_TEXT_CHARS = 1 << 16  # short enough that a text below it holds up the requests behind it only briefly


class TokenizerLane:
    """One thread, and the checker (with its tokenizer) and chat renderer it alone uses."""

    def __init__(self, checker: RequestChecker, chat: ChatRenderer, name: str):
        self.checker, self.chat, self.tokenizer = checker, chat, checker.tokenizer
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn, *args):
        """fn(*args) in this lane's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


def make_lanes(checker: RequestChecker, chat: ChatRenderer) -> tuple[TokenizerLane, TokenizerLane]:
    """The short texts' lane (the engine's own tokenizer) and the long texts' (a copy); one
    lane for both where the tokenizer does not copy (a remote-code tokenizer's state)."""
    short = TokenizerLane(checker, chat, "nanovllm-tokenizer")
    try:
        tokenizer = copy.deepcopy(checker.tokenizer)
    except Exception as exc:
        logger.info("the tokenizer does not copy (%s): long prompts share the one tokenizer thread", exc)
        return short, short
    own_checker, own_chat = copy.copy(checker), copy.copy(chat)
    own_checker.tokenizer = own_chat.tokenizer = tokenizer
    return short, TokenizerLane(own_checker, own_chat, "nanovllm-tokenizer-long")
