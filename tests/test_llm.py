"""The public API: LLM, SamplingParams, RequestOutput, engine arguments and errors."""
from __future__ import annotations

import json
import os
import shutil

import numpy
import pytest
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.testing.checkpoints import hf_greedy
from parity import fail_at_call

CPU = dict(device="cpu", dtype="float32", kvcache_block_size=16, num_kvcache_blocks=64)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt):
    with LLM(str(qwen3_ckpt), **CPU) as engine:
        yield engine


def test_string_prompts_in_order_with_text(llm, qwen3_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_ckpt)
    prompts = ["Hello world", "def add(a, b):", "Once upon a time there was"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = hf_greedy(qwen3_ckpt, [tokenizer.encode(p) for p in prompts], 6, ignore_eos=True)
    assert [o.prompt for o in outputs] == prompts
    for out, ref in zip(outputs, expected):
        assert out.prompt_token_ids == tokenizer.encode(out.prompt)
        completion = out.outputs[0]
        assert completion.token_ids == ref
        assert completion.text == tokenizer.decode(ref, skip_special_tokens=True)
        assert completion.finish_reason == "length" and out.finished
    assert len({o.request_id for o in outputs}) == 3


def test_single_prompt_and_per_prompt_params(llm):
    [single] = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(single.outputs[0].token_ids) == 3
    outputs = llm.generate(
        [[5, 6, 7], [8, 9]],
        [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(temperature=0.7, max_tokens=5, ignore_eos=True)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    assert outputs[1].prompt is None


def test_bad_requests_raise_and_leave_the_engine_clean(llm):
    manager = llm.scheduler.block_manager
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", [1] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    for ids in ([1, 2, 10**6], [3, -1]):
        with pytest.raises(ValueError, match="vocabulary"):
            llm.generate([ids], use_tqdm=False)
    for ids in ([1, True], [1, 2.0], [1, "2"]):
        with pytest.raises(ValueError, match="prompt of token ids must hold ints only"):
            llm.generate([ids], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="^the prompt is not valid text: surrogates not allowed at character 2$"):
        llm.generate("ab\ud800", use_tqdm=False)  # (a lone surrogate: the tokenizers library's TypeError)
    assert llm.is_finished() and manager.num_used_blocks == 0
    [out] = llm.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", float("nan"), "temperature"), ("n", 0, "n must be"), ("top_k", -5, "top_k"),
    ("min_tokens", 50, "min_tokens"), ("stop", ["", "x"], "stop"),
])
def test_params_changed_after_construction_are_checked_too(llm, field, value, message):
    """A field set after construction is checked when the request is made (it sampled NaN
    temperatures as token 0, and n=0 raised an IndexError); the engine serves on."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=message):
        llm.generate(["changed", "fine"], [params, SamplingParams(max_tokens=2)], use_tqdm=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a+"))
    params.structured_outputs.choice = ["b"]
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate("changed", params, use_tqdm=False)
    assert llm.is_finished() and llm.scheduler.block_manager.num_used_blocks == 0
    [out] = llm.generate("still serving", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
        (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_model_len=100_000), r"max_model_len \(100000\) exceeds the model's context \(512"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(kvcache_block_size=0), "kvcache_block_size"),
        (dict(num_kvcache_blocks=0), "num_kvcache_blocks"),
        (dict(enforce_eager="no"), "enforce_eager"),
        (dict(enable_prefix_caching=1), "enable_prefix_caching"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size"),  # does not divide 4 heads
        (dict(device="tpu"), "device"),
        (dict(dtype="int8"), "dtype"),
        (dict(seed="x"), "seed"),
        (dict(seed=2**70), "seed must be a 64-bit signed integer"),
        (dict(num_kvcache_blocks=True), "num_kvcache_blocks"),
        (dict(gpu_memory_utilization=True), "gpu_memory_utilization"),
        (dict(load_format="pt"), "load_format"),
        (dict(enable_chunked_prefill=False), "enable_chunked_prefill=False is not supported"),
    ],
)
def test_engine_arguments_are_checked(qwen3_ckpt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(qwen3_ckpt), **{**CPU, **kwargs})


def test_triton_attention_on_cpu_asks_for_the_interpreter(qwen3_ckpt, monkeypatch):
    from nanovllm.config import Config

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs a CUDA GPU .*TRITON_INTERPRET=1"):
        Config(str(qwen3_ckpt), device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Config(str(qwen3_ckpt), device="cpu", attention_backend="triton").kernels == "triton"


def test_vllm_engine_arguments_seed_none_and_chunked_prefill(qwen3_ckpt):
    from nanovllm.config import Config

    seeds = {Config(str(qwen3_ckpt), seed=None, enable_chunked_prefill=True).seed for _ in range(4)}
    assert all(isinstance(seed, int) for seed in seeds) and len(seeds) > 1


def test_a_cache_too_large_to_allocate_says_so_and_max_logprobs_stops_at_the_vocabulary(qwen3_ckpt):
    with pytest.raises(MemoryError, match=r"^KV cache of 1000000000 blocks \(.* GiB\) cannot be allocated on cpu: "
                                          r"lower num_kvcache_blocks"):
        LLM(str(qwen3_ckpt), **{**CPU, "num_kvcache_blocks": 10**9})
    with LLM(str(qwen3_ckpt), **{**CPU, "max_logprobs": 10**9}) as llm:  # (not 10**9 rows of host buffers)
        assert llm.config.max_logprobs == llm.config.hf_config.vocab_size


def test_a_progress_bar_maker_is_taken_as_vllms_use_tqdm(llm):
    made = []

    def bar(**kwargs):
        made.append(kwargs)
        return tqdm(**kwargs, disable=True)

    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=bar)
    assert made[0]["total"] == 2 and made[0]["desc"] == "Generating"
    with pytest.raises(TypeError):  # a maker that fails adds no request
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=lambda total: tqdm(total=total))
    assert llm.is_finished() and llm.scheduler.block_manager.num_used_blocks == 0


def test_a_model_that_is_not_a_path_is_named():
    with pytest.raises(TypeError, match="^model must be a local Hugging Face checkpoint folder \\(a path\\), got "
                                        "NoneType$"):
        LLM(None)


def test_unknown_engine_argument_is_a_type_error(qwen3_ckpt):
    with pytest.raises(TypeError, match="max_num_seq'"):
        LLM(str(qwen3_ckpt), max_num_seq=4)


def test_missing_folder_and_unsupported_architecture(tmp_path, qwen3_ckpt):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "nowhere"))
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((qwen3_ckpt / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    for f in qwen3_ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(bad), **CPU)


def test_unreadable_weights_name_their_file(tmp_path, qwen3_ckpt):
    """A truncated weights file, or a shard its index names but the folder lacks: a
    ValueError naming the file (the CLI's exit status 2), not safetensors' bare message."""
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cannot read the weights in .*broken/model.safetensors: .*header"):
        LLM(str(broken), **CPU)
    weights.unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "part-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"weights in .*part-1.safetensors: no such file"):
        LLM(str(broken), **CPU)


def test_the_default_max_model_len_is_the_models_and_eos_comes_from_generation_config(qwen3_ckpt):
    with LLM(str(qwen3_ckpt), **CPU) as engine:  # a model of 512 positions, as vLLM takes it
        assert engine.config.max_model_len == 512
        expected = json.loads((qwen3_ckpt / "generation_config.json").read_text())["eos_token_id"]
        assert set(expected) <= engine.eos_token_ids


def test_a_yarn_model_runs_to_its_stretched_context_as_transformers(tmp_path):
    """YaRN, factor 4 over 32 original positions: the model takes 128 positions where
    max_position_embeddings says 64, and greedy tokens past 64 equal transformers'."""
    from nanovllm.testing.checkpoints import make_tiny_checkpoint

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    path = make_tiny_checkpoint(tmp_path / "yarn", "qwen3", rope_scaling=yarn, max_position_embeddings=64)
    prompt = list(range(5, 65))
    expected = hf_greedy(path, [prompt], 40, ignore_eos=True)
    with LLM(str(path), **CPU) as engine:
        assert engine.config.max_model_len == 128
        [out] = engine.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40,
                                                                             ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == expected[0]


def test_seeded_sampling_is_reproducible_and_dummy_weights_load(qwen3_ckpt):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(str(qwen3_ckpt), seed=123, **CPU) as engine:
            runs.append([o.outputs[0].token_ids for o in engine.generate(["a b c", "x"], params, use_tqdm=False)])
    assert runs[0] == runs[1]
    with LLM(str(qwen3_ckpt), load_format="dummy", **CPU) as engine:
        [out] = engine.generate("a", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3


def test_shutdown_releases_the_engine(qwen3_ckpt):
    engine = LLM(str(qwen3_ckpt), **CPU)
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert engine.executor is None and engine.scheduler is None


def test_checkpoint_dtype_is_the_default(tmp_path):
    from nanovllm.testing.checkpoints import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "bf16", "qwen3", dtype=torch.bfloat16)
    with LLM(str(path), device="cpu", num_kvcache_blocks=8, kvcache_block_size=16) as engine:
        assert engine.executor.runner.dtype == torch.bfloat16
        [out] = engine.generate("hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 2


def test_triton_backend_refuses_a_head_dim_it_cannot_tile(llama_ckpt):
    # The llama fixture's head_dim is 8; the kernels tile 16 to 256.
    with pytest.raises(ValueError, match="head_dim"):
        LLM(str(llama_ckpt), attention_backend="triton", **CPU)


def test_vllm_prompt_forms_alone_and_mixed(llm):
    from nanovllm.inputs import TextPrompt, TokensPrompt

    ids = llm.tokenizer.encode("Hello world")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ("Hello world", ids, TextPrompt(prompt="Hello world"), TokensPrompt(prompt_token_ids=ids)):
        [out] = llm.generate(prompt, params, use_tqdm=False)
        assert out.outputs[0].token_ids == expected and out.prompt_token_ids == ids
    mixed = llm.generate(["Hello world", {"prompt_token_ids": ids}, {"prompt": "Hello world"}, ids], params,
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [expected] * 4
    assert llm.generate([], params, use_tqdm=False) == []


@pytest.mark.parametrize(("prompts", "params", "message"), [
    (b"bytes", None, "prompts must be .*got bytes"),
    ([b"bytes"], None, "prompt 0 is of type bytes"),
    ({"prompt_token_ids": [1], "extra": 1}, None, "keys \\['extra', 'prompt_token_ids'\\]"),
    ([{"text": "a"}], None, "prompt 0 is a dict"),
    ([1, "a"], None, "^a prompt of token ids must hold ints only; its item 1 is str 'a'$"),  # one prompt, meant
    ([5, numpy.int64(2)], None, "its item 1 is int64 .*\\.tolist\\(\\)"),
    ("a", "notparams", "sampling_params must be SamplingParams or a list of them"),
    (["a"], [object()], "sampling_params must be SamplingParams"),
    (["a", "b"], [SamplingParams(), None], "sampling_params must be .*; item 1 is NoneType$"),
    ([numpy.int64(1), numpy.int64(2)], None, "its item 0 is int64 .*\\.tolist\\(\\)"),
])
def test_misused_generate_says_what_is_wrong(llm, prompts, params, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, params, use_tqdm=False)
    assert llm.is_finished()


@pytest.mark.parametrize(("prompts", "message"), [
    (["Hello", [1, "x"]], "^prompt 1: a prompt of token ids must hold ints only; its item 1 is str 'x'$"),
    ([[1, 2], [2.5]], "^prompt 1: .* its item 0 is float 2.5$"),
    ([["a"]], "^a prompt of token ids must hold ints only; its item 0 is str 'a'$"),  # one prompt: no number
    ([[1, numpy.int64(2)]], "^a prompt of token ids must hold ints only; its item 1 is int64 .*\\.tolist\\(\\)"),
    (["Hello", ""], "^prompt 1: the prompt is empty"),
    ([[1], [10**9]], "^prompt 1: token ids \\[1000000000\\] are outside the vocabulary"),
])
def test_a_bad_prompt_among_several_is_named(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.is_finished()


def test_params_that_do_not_suit_one_of_several_prompts_are_named(llm):
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, stop_token_ids=[10**9])]
    with pytest.raises(ValueError, match="^prompt 1: stop_token_ids \\[1000000000\\] are outside the vocabulary"):
        llm.generate(["Hello", "there"], params, use_tqdm=False)
    assert llm.is_finished()


def test_a_conversation_too_long_is_named(llm):
    conversations = [[{"role": "user", "content": "Hello"}], [{"role": "user", "content": "Hello " * 5000}]]
    with pytest.raises(ValueError, match="^conversation 1: prompt .* leaves no room"):
        llm.chat(conversations, SamplingParams(max_tokens=2), use_tqdm=False,
                 chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert llm.is_finished()


def test_a_shut_down_llm_says_so(qwen3_ckpt):
    """Every call after shutdown() is one clear error; aborting then is a no-op."""
    engine = LLM(str(qwen3_ckpt), **CPU)
    request = engine.make_request("Hello", SamplingParams(max_tokens=3))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("Hello", use_tqdm=False)
    for call in (lambda: engine.add_request(request), engine.stats, engine.reset_stats, engine.warm_up_sampler,
                 lambda: engine.num_kvcache_blocks):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    engine.abort_request(request)


def test_the_streaming_calls_take_only_this_engines_requests_once(llm, qwen3_ckpt):
    """add_request takes a request once (not again, not once aborted); a request of
    another LLM, or anything that is not a Request, is refused by add, abort and output,
    and this engine is left as it was."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    request = llm.make_request("Hello", params)
    llm.add_request(request)
    with pytest.raises(ValueError, match="added or aborted already"):
        llm.add_request(request)
    while not llm.is_finished():
        llm.step()
    with pytest.raises(ValueError, match="added or aborted already"):
        llm.add_request(request)
    assert len(llm.output(request).outputs[0].token_ids) == 3
    aborted = llm.make_request("Hello", params)
    llm.abort_request(aborted)
    with pytest.raises(ValueError, match="added or aborted already"):
        llm.add_request(aborted)
    for call in (llm.add_request, llm.abort_request, llm.output):
        with pytest.raises(TypeError, match="takes a Request from make_request, got str"):
            call("Hello")
    with LLM(str(qwen3_ckpt), **CPU) as other:
        theirs = other.make_request("Hello", params)
        other.add_request(theirs)
        other.step()
        for call in (llm.add_request, llm.abort_request, llm.output):
            with pytest.raises(ValueError, match="made by another LLM"):
                call(theirs)
        while not other.is_finished():
            other.step()
        assert len(other.output(theirs).outputs[0].token_ids) == 3
    assert llm.is_finished() and llm.scheduler.block_manager.num_used_blocks == 0


def test_a_request_runs_on_its_own_copy_of_the_params(llm):
    """Changing params after make_request (before add_request, or while it runs) changes
    nothing, as vLLM's copy: the tokens are those of the params as they were (before, an
    allowed_token_ids past the vocabulary raised an IndexError inside a step)."""
    [expected] = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    request = llm.make_request("Hello", params)
    params.temperature = -1.0
    params.stop_token_ids.append(expected.outputs[0].token_ids[2])  # (in place: the lists are copied too)
    llm.add_request(request)
    llm.step()
    params.allowed_token_ids, params.max_tokens, params.stop = [10**6], None, [""]
    while not llm.is_finished():
        llm.step()
    assert llm.output(request).outputs[0].token_ids == expected.outputs[0].token_ids
    assert llm.scheduler.block_manager.num_used_blocks == 0


def test_a_folder_without_tokenizer_files_is_refused(qwen3_ckpt, tmp_path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((qwen3_ckpt / name).read_bytes())
    with pytest.raises(ValueError, match="no tokenizer files"):
        LLM(str(tmp_path), **CPU)


def test_chat_equals_generate_on_the_rendered_template(llm):
    conversation = [{"role": "user", "content": "Hello there"}]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    [reply] = llm.chat(conversation, params, use_tqdm=False)
    text = llm.get_tokenizer().apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    [expected] = llm.generate([llm.tokenizer.encode(text, add_special_tokens=False)], params, use_tqdm=False)
    assert reply.prompt == text and reply.outputs[0].token_ids == expected.outputs[0].token_ids
    both = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Hi"}, {"role": "user",
                                                                                          "content": "More"}]],
                    params, use_tqdm=False)
    assert both[0].outputs[0].token_ids == expected.outputs[0].token_ids and len(both) == 2
    plain = llm.chat(conversation, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}:",
                     add_generation_prompt=False)
    assert plain[0].prompt == "Hello there:"


def test_vllms_lora_request_priority_and_argument_order(llm):
    """generate and chat take vLLM's lora_request (None only) and priority (0 alone under
    first come, first served, as vLLM's), and chat its arguments in vLLM's order."""
    conversation = [{"role": "user", "content": "Hello there"}]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [plain] = llm.generate(["Hello"], params, use_tqdm=False)
    [same] = llm.generate(["Hello"], params, False, None, [0])
    assert same.outputs[0].token_ids == plain.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"priority \(5\) needs scheduling_policy='priority'"):
        llm.generate(["Hello"], params, False, None, [5])
    with pytest.raises(ValueError, match="one integer per prompt"):
        llm.generate(["Hello", "there"], params, False, None, [0])
    template = "{{ messages[0]['content'] }}:"
    [ordered] = llm.chat(conversation, params, False, None, template, "string", False)  # vLLM's positions
    assert ordered.prompt == "Hello there:"
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate(["Hello"], params, use_tqdm=False, lora_request="adapter")
    with pytest.raises(ValueError, match="LoRA"):
        llm.chat(conversation, params, use_tqdm=False, lora_request="adapter")
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(conversation, params, use_tqdm=False, chat_template_content_format="openai")


def test_priority_scheduling_runs_the_lower_value_first(qwen3_ckpt):
    """scheduling_policy="priority": of requests waiting together, the lowest priority value
    starts first (one sequence at a time here), and the outputs are the same tokens."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(str(qwen3_ckpt), **{**CPU, "max_num_seqs": 1}, scheduling_policy="priority") as engine:
        outputs = engine.generate(["one", "two", "three"], params, use_tqdm=False, priority=[3, -1, 2])
        requests = [engine.make_request(p, params, priority=v) for p, v in (("one", 3), ("two", -1), ("three", 2))]
        for request in requests:
            engine.add_request(request)
        by_seq = {request.seqs[0].seq_id: request.prompt for request in requests}
        finished = []
        while not engine.is_finished():
            finished += [by_seq[seq.seq_id] for seq in engine.step().finished]
        with pytest.raises(ValueError, match="priority must be an integer"):
            engine.make_request("one", params, priority=1.5)
        engine.make_request("one", params, priority=numpy.int64(2))  # numpy's integers are integers
    assert finished == ["two", "three", "one"]
    with LLM(str(qwen3_ckpt), **CPU) as fcfs:
        assert [o.outputs[0].token_ids for o in fcfs.generate(["one", "two", "three"], params, use_tqdm=False)] == [
            o.outputs[0].token_ids for o in outputs]


def test_chat_takes_text_parts_and_continues_a_final_message(llm):
    """OpenAI's content parts are the same text joined by newlines (as the server joins
    them); continue_final_message ends the prompt inside the last message; a message
    without a role, or with an image, is a TypeError that says so."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    [a] = llm.chat(parts, params, use_tqdm=False)
    [b] = llm.chat([{"role": "user", "content": "Hello\nthere"}], params, use_tqdm=False)
    assert a.prompt == b.prompt and a.outputs[0].token_ids == b.outputs[0].token_ids
    begun = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, I"}]
    [c] = llm.chat(begun, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    text = llm.tokenizer.apply_chat_template(begun, continue_final_message=True, tokenize=False)
    assert c.prompt == text and text.endswith("Well, I")
    [expected] = llm.generate([llm.tokenizer.encode(text, add_special_tokens=False)], params, use_tqdm=False)
    assert c.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(begun, params, continue_final_message=True)
    with pytest.raises(TypeError, match="must be a dict with a string 'role'"):
        llm.chat([{"content": "Hi"}], params)
    with pytest.raises(TypeError, match=r"text only\), got types \['image_url'\]"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params)
    with pytest.raises(TypeError, match=r"got types \['text'\] with text of types \['int'\]$"):
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}], params)


def test_chat_templates_from_files_and_their_errors(llm, tmp_path):
    """chat_template may name a file (its text renders, as the command line's flag); a
    template's own error, chat_template_kwargs that are no dict or set chat()'s own
    arguments, are one clear error each; a message without content has content None."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conversation = [{"role": "user", "content": "Hello there"}]
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}:")
    [reply] = llm.chat(conversation, params, use_tqdm=False, chat_template=str(tmp_path / "t.jinja"),
                       add_generation_prompt=False)
    assert reply.prompt == "Hello there:"
    refusing = "{{ raise_exception('no assistants here') }}"
    with pytest.raises(ValueError, match="could not format conversation 0: no assistants here"):
        llm.chat([conversation, conversation], params, chat_template=refusing)
    for failing, error in [("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
                           ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
                           ("{% for i in range(10**7) %}{% endfor %}", "OverflowError")]:
        with pytest.raises(ValueError, match=f"the chat template could not format the conversation: {error}"):
            llm.chat(conversation, params, chat_template=failing)
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(conversation, params, chat_template_kwargs="x")
    with pytest.raises(ValueError, match="may not set add_generation_prompt, tools: pass them as chat"):
        llm.chat(conversation, params, chat_template_kwargs={"add_generation_prompt": False, "tools": []})
    [tool_turn] = llm.chat(conversation + [{"role": "assistant"}, {"role": "user", "content": "More"}], params,
                           use_tqdm=False, chat_template="{% for m in messages %}{{ m['content'] }};{% endfor %}")
    assert tool_turn.prompt == "Hello there;;More;"  # the template renders None as nothing
    assert llm.is_finished()


def test_a_chat_template_flag_is_a_file_or_a_template(tmp_path):
    from nanovllm.inputs import load_chat_template

    template = "{{ messages[0]['content'] }}"
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template  # a file: its text
    assert load_chat_template(template) == template and load_chat_template(None) is None
    with pytest.raises(ValueError, match="no chat template file"):  # no Jinja tag: a file's name
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(TypeError, match="chat_template must be a template or the name of a file holding one, got int"):
        load_chat_template(5)  # (not a file descriptor)


def test_chat_shows_tools_to_the_template(qwen3_tools_ckpt):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with LLM(str(qwen3_tools_ckpt), **CPU) as engine:
        [reply] = engine.chat([{"role": "user", "content": "Time?"}], SamplingParams(max_tokens=2), use_tqdm=False,
                              tools=tools, chat_template_kwargs={"enable_thinking": False})
    assert '"name": "get_time"' in reply.prompt and reply.prompt.endswith("<think>\n\n</think>\n\n")


def test_generation_config_gives_the_defaults_of_requests_without_parameters(qwen3_ckpt, tmp_path):
    """vLLM's precedence: a request's own SamplingParams, else the checkpoint's
    generation_config.json, else SamplingParams' defaults; generation_config="vllm" skips it."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in qwen3_ckpt.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.3, "top_k": 7, "top_p": 0.8,
                                                             "max_new_tokens": 5}))
    with LLM(str(ckpt), **CPU) as engine:
        defaults = engine.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty) == (0.3, 7, 0.8, 1.0)
        assert engine.generation_defaults == {"temperature": 0.3, "top_k": 7, "top_p": 0.8, "max_tokens": 5}
        assert defaults.max_tokens == 5
    with LLM(str(ckpt), generation_config="vllm", **CPU) as engine:  # the model's end tokens stay
        assert engine.get_default_sampling_params() == SamplingParams()
        end = config["eos_token_id"]
        assert set(end if isinstance(end, list) else [end]) <= engine.eos_token_ids
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "eos_token_id": [5, 6]}))
    with LLM(str(ckpt), generation_config=str(other), **CPU) as engine:  # its end tokens too, as vLLM's
        assert engine.get_default_sampling_params().temperature == 0.0
        assert {5, 6} <= engine.eos_token_ids and engine.eos_token_ids - {5, 6} <= {engine.tokenizer.eos_token_id}


def test_end_of_sequence_ids_past_the_vocabulary_are_left_out(qwen3_ckpt, tmp_path, caplog):
    for f in qwen3_ckpt.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 1000000]}')
    with LLM(str(tmp_path), **CPU) as engine:
        assert 7 in engine.eos_token_ids and 1000000 not in engine.eos_token_ids
    assert "eos_token_id [1000000] past the model's vocabulary (384) left out" in caplog.text


@pytest.mark.parametrize(("content", "error"), [
    ("[1]", "generation_config.json must hold a JSON object, got list"),
    ("{bad", "cannot read .*generation_config.json: Expecting property name"),
    ('{"eos_token_id": "abc"}', "generation_config.json: eos_token_id must be a token id or a list of them"),
    ('{"eos_token_id": [[1]]}', "generation_config.json: eos_token_id must be a token id"),
    ('{"temperature": -1}', "generation_config.json: temperature must be a number >= 0"),
])
def test_a_broken_generation_config_is_named_at_start_up(qwen3_ckpt, tmp_path, content, error):
    """Refused as the engine starts, naming the file (not an AttributeError, nor an error
    in the first request that takes its defaults)."""
    for f in qwen3_ckpt.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=error):
        LLM(str(tmp_path), **CPU)


def test_vllm_engine_argument_names_and_a_tokenizer_folder(qwen3_ckpt, tmp_path):
    tokenizer_only = tmp_path / "tokenizer"
    tokenizer_only.mkdir()
    for f in qwen3_ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (tokenizer_only / f.name).write_bytes(f.read_bytes())
    args = {k: v for k, v in CPU.items() if k not in ("kvcache_block_size", "dtype")}
    with LLM(str(qwen3_ckpt), block_size=8, dtype="half", tokenizer=str(tokenizer_only),
             trust_remote_code=False, **args) as engine:
        assert engine.config.kvcache_block_size == 8 and engine.executor.runner.dtype == torch.float16
        assert engine.get_tokenizer().encode("Hello") == AutoTokenizer.from_pretrained(qwen3_ckpt).encode("Hello")
    with pytest.raises(TypeError, match="not both"):
        LLM(str(qwen3_ckpt), block_size=8, kvcache_block_size=8)
    from nanovllm.config import Config

    assert Config(str(qwen3_ckpt), dtype=torch.float16).torch_dtype == torch.float16  # a torch dtype, as vLLM takes
    # vLLM's arguments that change nothing here, at values that change nothing
    config = Config.from_kwargs(str(qwen3_ckpt), swap_space=4, disable_log_stats=True, tokenizer_mode="auto",
                                distributed_executor_backend="mp", revision=None, num_gpu_blocks_override=None)
    assert config.num_kvcache_blocks == -1
    assert Config.from_kwargs(str(qwen3_ckpt), num_gpu_blocks_override=12).num_kvcache_blocks == 12
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        Config.from_kwargs(str(qwen3_ckpt), pipeline_parallel_size=2)
    with pytest.raises(TypeError, match="unknown engine argument 'no_such_argument'"):
        Config.from_kwargs(str(qwen3_ckpt), no_such_argument=1)
    with pytest.raises(ValueError, match="dtype must be one of"):
        Config(str(qwen3_ckpt), dtype=torch.int8)


def test_cpu_threads(qwen3_ckpt, monkeypatch):
    """All cores but one unless told otherwise: torch's one per core crawls when another
    process holds a core."""
    from nanovllm.config import Config

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert Config(str(qwen3_ckpt)).cpu_thread_count() == max(1, cores - 1)
    assert Config(str(qwen3_ckpt), cpu_threads=3).cpu_thread_count() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert Config(str(qwen3_ckpt)).cpu_thread_count() is None
    before = torch.get_num_threads()
    try:
        with LLM(str(qwen3_ckpt), cpu_threads=1, **CPU):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_reasoning_parser_the_tokenizer_cannot_serve_is_refused_before_the_model_is_built(monkeypatch):
    from nanovllm.demo import DEMO_MODEL_DIR
    from nanovllm.engine import llm_engine

    def build(config):
        raise AssertionError("the model was built first")

    monkeypatch.setattr(llm_engine.Executor, "create", staticmethod(build))
    with pytest.raises(ValueError, match="the qwen3 reasoning parser needs <think> and </think>"):
        LLM(DEMO_MODEL_DIR, reasoning_parser="qwen3", device="cpu")


def test_reset_prefix_cache_as_vllm(llm):
    """A prompt seen before hits the prefix cache; after reset_prefix_cache it is computed
    again with the same output. While a request runs the reset refuses (False)."""
    prompt = list(range(1, 50))  # three 16-token blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [first] = llm.generate([prompt], params, use_tqdm=False)
    assert llm.reset_prefix_cache()
    [fresh] = llm.generate([prompt], params, use_tqdm=False)
    [again] = llm.generate([prompt], params, use_tqdm=False)
    assert (fresh.num_cached_tokens, again.num_cached_tokens) == (0, 48)
    assert fresh.outputs[0].token_ids == again.outputs[0].token_ids == first.outputs[0].token_ids
    request = llm.make_request(prompt, params)
    llm.add_request(request)
    llm.step()
    assert not llm.reset_prefix_cache()  # running: refused, and the cache kept
    while not llm.is_finished():
        llm.step()
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 48
    assert llm.reset_prefix_cache()


def test_a_step_whose_reading_fails_ends_its_requests_and_the_engine_serves_on(llm, monkeypatch):
    """An error while a step's tokens are recorded (the output processor's, at its third
    read) reaches the caller and ends that step's sequences ("abort"; here each a request's
    one), freeing their blocks;
    the step launched meanwhile is not lost, and the engine serves the next request."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    requests = [llm.make_request([5 + i] * 20, params) for i in range(3)]
    for request in requests:
        llm.add_request(request)
    fail_at_call(monkeypatch, llm.output_processor, "process", 3, RuntimeError("one token too many"))
    with pytest.raises(RuntimeError, match="one token too many"):
        while not llm.is_finished():
            llm.step()
    monkeypatch.undo()
    while not llm.is_finished():
        llm.step()
    assert [llm.output(request).outputs[0].finish_reason for request in requests] == ["abort"] * 3
    assert llm.scheduler.block_manager.num_used_blocks == 0
    [out] = llm.generate("still serving", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_a_failed_step_ends_its_sequences_and_a_waiting_completion_runs_on(qwen3_ckpt, monkeypatch):
    """Containment ends the failed step's sequences, not whole requests: with one sequence
    a step, an n=2 request's first completion ends "abort" and its second, still waiting
    then, runs to its length with the tokens it gets alone."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(qwen3_ckpt), max_num_seqs=1, **CPU) as engine:
        [alone] = engine.generate([[5] * 20], greedy, use_tqdm=False)
        request = engine.make_request([5] * 20, SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True))
        engine.add_request(request)
        fail_at_call(monkeypatch, engine.output_processor, "process", 3, RuntimeError("one token too many"))
        with pytest.raises(RuntimeError, match="one token too many"):
            while not engine.is_finished():
                engine.step()
        monkeypatch.undo()
        while not engine.is_finished():
            engine.step()
        first, second = engine.output(request).outputs
        assert (first.finish_reason, second.finish_reason) == ("abort", "length")
        assert second.token_ids == alone.outputs[0].token_ids
        assert engine.scheduler.block_manager.num_used_blocks == 0


def test_a_generate_whose_launch_fails_leaves_the_engine_idle(llm, monkeypatch):
    """generate() raises a failed launch's error and leaves nothing in flight: the engine
    is idle (is_finished, every block free, reset_prefix_cache allowed) and serves on."""
    fail_at_call(monkeypatch, llm.executor, "launch", 3, RuntimeError("the launch failed"))
    with pytest.raises(RuntimeError, match="the launch failed"):
        llm.generate([[5] * 20, [6] * 20], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert llm.is_finished() and llm.scheduler.block_manager.num_used_blocks == 0
    assert llm.reset_prefix_cache()
    [out] = llm.generate([7] * 20, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_after_a_failed_launch_the_step_in_flight_is_read_before_the_next(llm, monkeypatch):
    """A failed launch may have taken the next set of the double buffers, which the next
    launch would share with the step still in flight: that step is read first, and a
    request added after the failure gets the output it gets alone."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [alone] = llm.generate([[9] * 20], params, use_tqdm=False)
    llm.add_request(llm.make_request([5] * 20, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    fail_at_call(monkeypatch, llm.executor, "launch", 3, RuntimeError("the launch failed"))
    llm.step()
    llm.step()
    with pytest.raises(RuntimeError, match="the launch failed"):
        llm.step()
    monkeypatch.undo()
    assert llm.inflight is not None and llm.drain_first
    launch = llm.executor.launch

    def checked(*args, **kwargs):
        assert llm.inflight is None, "launched with a step in flight after a failed launch"
        return launch(*args, **kwargs)

    monkeypatch.setattr(llm.executor, "launch", checked)
    request = llm.make_request([9] * 20, params)
    llm.add_request(request)
    llm.step()
    monkeypatch.undo()
    while not llm.is_finished():
        llm.step()
    assert llm.output(request).outputs[0].token_ids == alone.outputs[0].token_ids
