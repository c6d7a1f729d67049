"""vLLM's offline calls, `generate`, `chat` and `beam_search`, for one engine (llm.py's
LLM) and for several replicas (serving/data_parallel.py) alike."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence as SequenceABC
from typing import Any

from jinja2 import TemplateError
from tqdm.auto import tqdm

from nanovllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from nanovllm.engine.request import PromptError
from nanovllm.inputs import (
    PromptType, chat_messages, check_chat_template, load_chat_template, parse_prompts, render_arguments,
    render_chat,
)
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils import is_int


@contextlib.contextmanager
def named(label: str, index: int, count: int) -> Iterator[None]:
    """A ValueError raised inside (a bad prompt, params that do not suit it, a grammar that
    does not compile) about one of `count` prompts says which ("prompt 3: ...", label
    "prompt" or "conversation")."""
    try:
        yield
    except ValueError as exc:
        if count == 1:
            raise
        raise (PromptError if isinstance(exc, PromptError) else ValueError)(f"{label} {index}: {exc}") from None


def own_copies(checker: Any) -> Callable[[SamplingParams], SamplingParams]:
    """For one call: each distinct params object's checked copy (RequestChecker.own), made
    once, so that prompts sharing an object share its copy (SamplingState reads each
    distinct object once) and it is checked once."""
    copies: dict[int, SamplingParams] = {}

    def own(params: SamplingParams) -> SamplingParams:
        if id(params) not in copies:
            copies[id(params)] = checker.own(params)
        return copies[id(params)]

    return own


def _which(index: int, conversations: list) -> str:
    return "the conversation" if len(conversations) == 1 else f"conversation {index}"


def progress_bar(use_tqdm: bool | Callable[..., tqdm], **kwargs: Any) -> tqdm:
    """vLLM's use_tqdm: a tqdm bar or none (True / False), or the callable that makes the bar
    (functools.partial(tqdm, leave=False), say)."""
    if callable(use_tqdm):
        return use_tqdm(**kwargs)
    return tqdm(**kwargs, disable=not use_tqdm)


def no_lora(lora_request: object) -> None:
    """vLLM's lora_request, which only None suits here."""
    if lora_request is not None:
        raise ValueError("LoRA adapters are not supported: pass lora_request=None")


def make_each(prompts: list[tuple[str | list[int], str | None]], params: list[SamplingParams],
              make: Callable[[int, str | list[int], SamplingParams], Any], label: str) -> list[Any]:
    """make(index, prompt, params) for each (prompt, text) of a call, its errors `named`."""
    made = []
    for i, ((prompt, _), sp) in enumerate(zip(prompts, params)):
        with named(label, i, len(prompts)):
            made.append(make(i, prompt, sp))
    return made


class OfflineAPI:
    """vLLM's offline calls, generate, chat and beam_search, over `_generate` and
    `get_default_sampling_params`: one engine (LLM) or several replicas
    (serving/data_parallel.py)."""

    tokenizer: Any
    config: Any
    checker: Any  # engine/request.py's RequestChecker: the most tokens a request may hold
    eos_token_ids: set[int]

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (any of vLLM's prompt forms, see nanovllm/inputs.py);
        results come back in input order. Without sampling_params, the checkpoint's
        recommended ones (get_default_sampling_params). lora_request is vLLM's (no LoRA
        here); priority: one per prompt, lower first, with scheduling_policy="priority"."""
        no_lora(lora_request)
        prompts = parse_prompts(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(prompts)):
            raise ValueError(f"priority must be a list of one integer per prompt ({len(prompts)}), got {priority!r}")
        return self._generate([(p, p if isinstance(p, str) else None) for p in prompts], params, use_tqdm,
                              priorities=priority)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages, content a
        string or OpenAI's text parts) or to each of a list of them, rendered with the
        tokenizer's chat template (or chat_template); the same outputs as generate, each
        with the rendered text as its prompt. continue_final_message: go on with the last
        message (an assistant's reply begun) instead of starting a new one; it needs
        add_generation_prompt=False. tools: OpenAI function definitions for the template to
        show the model (as vLLM's LLM.chat). The arguments come in vLLM's order; a message's
        content reaches the template as one string (chat_template_content_format "string",
        which "auto" is here)."""
        no_lora(lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format must be 'auto' or 'string' (content goes to the template "
                             f"as one string), got {chat_template_content_format!r}")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role', 'content'} dicts) or a list of them")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: set add_generation_prompt=False")
        single = isinstance(messages[0], dict)
        conversations = [chat_messages(messages)] if single else [
            chat_messages(c, f"conversation {i}") for i, c in enumerate(messages)]
        params = self._params_per_prompt(sampling_params, len(conversations))
        kwargs = template_kwargs(chat_template_kwargs)
        if tools:
            kwargs["tools"] = tools
        template = load_chat_template(chat_template)  # a template, or a file holding one
        check_chat_template(self.tokenizer, template)
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                text, token_ids = render_chat(self.tokenizer, conversation, template, add_generation_prompt,
                                              continue_final_message, **kwargs)
            except (TemplateError, TypeError) as exc:  # the template's own: a role it refuses, a key it needs
                raise ValueError(f"the chat template could not format {_which(i, conversations)}: {exc}") from None
            except (ArithmeticError, LookupError, RecursionError, ValueError) as exc:  # its code failing
                raise ValueError(f"the chat template could not format {_which(i, conversations)}: "
                                 f"{type(exc).__name__}: {exc}") from exc
            prompts.append((token_ids, text))
        return self._generate(prompts, params, use_tqdm, "conversation")

    def beam_search(self, prompts: PromptType | SequenceABC[PromptType], params: BeamSearchParams,
                    lora_request: None = None, use_tqdm: bool | Callable[..., tqdm] = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (nanovllm/beam_search.py): params.beam_width beams a prompt,
        each of up to params.max_tokens new tokens; per prompt its best beams, best first.
        concurrency_limit: search that many prompts at a time (None: all at once)."""
        no_lora(lora_request)
        if concurrency_limit is not None and (not is_int(concurrency_limit) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        parsed = parse_prompts(prompts)
        limit = concurrency_limit or max(len(parsed), 1)
        searches = [BeamSearch(parsed[start: start + limit], params, self.eos_token_ids, self.config.max_logprobs,
                               self.checker.most_tokens) for start in range(0, max(len(parsed), 1), limit)]
        results = []
        with progress_bar(use_tqdm, total=params.max_tokens * len(searches), desc="Beam search",
                          dynamic_ncols=True) as bar:
            for search in searches:
                while asks := search.asks():
                    outputs = self.generate(asks, search.step_params, use_tqdm=False)
                    search.take([(out.prompt_token_ids, out.outputs[0].logprobs[0]) for out in outputs])
                    bar.update()
                results += search.results(self.get_tokenizer().decode)
        return results

    def _generate(self, prompts: list[tuple[str | list[int], str | None]], params: list[SamplingParams],
                  use_tqdm: bool, label: str = "prompt", priorities: list[int] | None = None) -> list[RequestOutput]:
        """Run each (prompt, its text for the output) with its params (and priority, if
        given); outputs in input order. label: what an error calls one of several prompts
        (make_each)."""
        raise NotImplementedError

    def _params_per_prompt(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if not isinstance(sampling_params, (list, tuple)):
            raise TypeError(f"sampling_params must be SamplingParams or a list of them (one per prompt); "
                            f"got {type(sampling_params).__name__}")
        if (i := next((i for i, sp in enumerate(sampling_params) if not isinstance(sp, SamplingParams)), None)
                ) is not None:
            raise TypeError(f"sampling_params must be SamplingParams or a list of them (one per prompt); "
                            f"item {i} is {type(sampling_params[i]).__name__}")
        if len(sampling_params) != count:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts; give one, or one per prompt")
        return list(sampling_params)


def template_kwargs(extra: Any) -> dict[str, Any]:
    """chat_template_kwargs as a new dict: a mapping of template variables, none of the
    rendering's own arguments (render_arguments: chat()'s among them)."""
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(key, str) for key in extra):
        raise TypeError(f"chat_template_kwargs must be a dict of template variables, got {type(extra).__name__}")
    clash = [key for key in extra if key in render_arguments()]
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: pass them as chat()'s arguments")
    return dict(extra)
