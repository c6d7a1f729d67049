"""The API process's half of an engine (RequestFrontend): the tokenizer, the limits and
the checkpoint's sampling defaults, which make and check requests before any reaches an
engine, so bad input costs no engine time and gets its ValueError at once."""
from __future__ import annotations

import itertools

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.model_files import load_eos_token_ids, load_generation_defaults, load_tokenizer
from nanovllm.engine.request import Prompt, RequestChecker
from nanovllm.engine.structured import GrammarCompiler
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams
from nanovllm.serving.messages import EngineRequest


class RequestFrontend:
    """The API process's half of an engine: the tokenizer, the limits and the checkpoint's
    sampling defaults, to make and check requests without the engine. AsyncLLMEngine is
    one; integrations/ray.py's client of remote engine replicas is another."""

    def __init__(self, config: Config, num_kvcache_blocks: int, tokenizer: PreTrainedTokenizerBase | None = None):
        self.config = config
        self.num_kvcache_blocks = num_kvcache_blocks
        self.generation_defaults = load_generation_defaults(config)
        self.tokenizer = tokenizer or load_tokenizer(config)
        self.eos_token_ids = load_eos_token_ids(config, self.tokenizer)
        self.checker = RequestChecker.from_config(config, self.tokenizer, num_kvcache_blocks, self.eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # made for the first structured request
        self._request_ids = itertools.count()

    def make_request(self, prompt: Prompt, params: SamplingParams, stream: bool = False,
                     request_id: str | None = None, fit: bool = False,
                     checker: RequestChecker | None = None, priority: int = 0,
                     copy_params: bool = True) -> EngineRequest:
        """Tokenize and check a request, raising ValueError (with LLMEngine.make_request's
        messages) for one that could never run. Nothing is sent to the engine yet. fit: a
        max_tokens past the context is lowered to it (offline), not refused (a server).
        checker: this frontend's checker with another tokenizer (one per thread). The
        request runs on a checked copy of params (copy_params=False: params made for it). With
        structured outputs and token constraints, the grammar is compiled (if a server's
        check_structured_outputs has not) to see that they leave it a first token."""
        checker = checker or self.checker
        token_ids, params, priority = checker.check_request(prompt, params, priority, fit, copy_params)
        if params.structured_outputs is not None and (params.allowed_token_ids is not None or params.bad_words):
            compiled = self.grammar_compiler().compile(params.structured_outputs).result()
            self.grammar_compiler().check_first_token(compiled, params, checker.bad_words_token_ids(params),
                                                      self.eos_token_ids)
        return EngineRequest(request_id if request_id is not None else str(next(self._request_ids)), token_ids, params,
                             stream, priority=priority)

    def check_structured_outputs(self, spec: StructuredOutputsParams) -> None:
        """Compile spec's grammar, raising ValueError (with the grammar compiler's message)
        if it cannot be. Blocking (up to the compile time; cached after): call it off the
        event loop, from any thread once grammar_compiler() has made the compiler (a server
        makes it in its tokenizer thread). The engine compiles its own copy, cached by the same
        text, when the request arrives."""
        self.grammar_compiler().check(spec)

    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler check_structured_outputs uses, made on the first call (it reads the
        tokenizer's vocabulary: a server calls this first from its tokenizer thread)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size, self.eos_token_ids)
        return self._grammars
