"""The offline API as code written against vLLM's calls it (on the bundled model): its quickstart loop,
token-id and dict prompts, ``n`` answers, ``cumulative_logprob``, ``SamplingParams`` keyword-only
with ``None`` for no stops and ``clone``, ``LLM(dtype="auto", max_model_len=, seed=)``, ``chat`` with
``add_generation_prompt`` / ``continue_final_message`` / ``chat_template``, and ``get_tokenizer``."""

import math

import pytest

from hypic import LLM, SamplingParams

MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Where does Mira live?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # a CPU test wherever it runs (on a GPU LLM() is bf16)


def test_vllms_quickstart_loop_runs(llm: LLM) -> None:
    prompts = ["Hello, my name is", "The president of the United States is"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, seed=0), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert all(o.finished and o.outputs[0].text == o.text for o in outputs)
    assert len({o.request_id for o in outputs}) == 2
    assert llm.generate(["a<<PIC_SEP>>b"], SamplingParams(max_tokens=1))[0].prompt == "a<<PIC_SEP>>b"
    assert llm.generate([["a", "b"]], SamplingParams(max_tokens=1))[0].prompt == "a<<PIC_SEP>>b"  # the same prompt
    assert llm.generate([[[5, 6], "b"]], SamplingParams(max_tokens=1))[0].prompt is None  # ids have no text here


def test_token_id_and_dict_prompts_take_vllms_shapes(llm: LLM) -> None:
    ids = llm.tokenize("Hello, my name is")[0]
    sp = SamplingParams(max_tokens=4)
    want = llm.generate([[ids]], sp)[0].token_ids  # hypic's own shape: a batch of one prompt of one segment
    other = llm.tokenize("The capital")[0]
    assert [o.token_ids for o in llm.generate([ids, other], sp)] == [want, llm.generate([[other]], sp)[0].token_ids]
    assert llm.generate(ids, sp)[0].token_ids == want
    assert llm.generate({"prompt_token_ids": ids}, sp)[0].token_ids == want
    assert llm.generate([{"prompt_token_ids": ids}], sp)[0].prompt_token_ids == ids
    assert llm.generate([{"prompt": "Hello, my name is"}], sp)[0].token_ids == want
    assert [d.token_ids for d in llm.stream({"prompt_token_ids": ids}, sp)][0] == want[:1]
    for bad, message in [({"prompt_token_ids": ids, "multi_modal_data": {}}, "'prompt_token_ids' alone"),
                         ({"prompt_token_ids": []}, "prompt_token_ids"), ({"text": "x"}, "'prompt' \\(text\\)")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([bad], sp)


def test_n_answers_are_the_prompts_runs_seeded_one_apart(llm: LLM) -> None:
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=0)
    out = llm.generate("Hello, my name is", sp)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.outputs[0] is out
    for i, c in enumerate(out.outputs):  # answer i is the request seeded seed + i
        alone = llm.generate("Hello, my name is", sp.clone(n=1, seed=5 + i))[0]
        assert c.token_ids == alone.token_ids and c.text == alone.text and c.request_id == out.request_id
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    unseeded = llm.generate("Hello, my name is", sp.clone(seed=None))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1
    both = llm.generate(["Hello", "The capital"], [SamplingParams(n=2, max_tokens=2), SamplingParams(max_tokens=3)])
    assert [len(o.outputs) for o in both] == [2, 1] and len(both[1].token_ids) == 3
    with pytest.raises(ValueError, match="n: stream yields one answer"):
        next(llm.stream("Hello", SamplingParams(n=2)))
    with pytest.raises(ValueError, match="n: the engine runs one answer"):
        llm.engine.start([[[5, 6, 7]]], [SamplingParams(n=2)])
    with pytest.raises(ValueError, match="n: expected an integer ≥ 1"):
        SamplingParams(n=0)


def test_cumulative_logprob_is_the_answers_score_as_the_prompt_scores_it(llm: LLM) -> None:
    """Independently: the answer appended to the prompt, scored by prompt_logprobs (a full forward)."""
    prompt = llm.tokenize("Hello, my name is")[0]
    out = llm.generate([[prompt]], SamplingParams(max_tokens=5, logprobs=0, ignore_eos=True), mode="full")[0]
    scored = llm.generate([[prompt + out.token_ids]], SamplingParams(max_tokens=1, prompt_logprobs=0), mode="full")[0]
    want = sum(lp[t] for t, lp in zip(out.token_ids, scored.prompt_logprobs[len(prompt):], strict=True))
    assert math.isclose(out.cumulative_logprob, want, abs_tol=1e-3)
    assert llm.generate([[prompt]], SamplingParams(max_tokens=2))[0].cumulative_logprob is None  # logprobs off


def test_sampling_params_as_vllm_callers_write_them() -> None:
    assert SamplingParams(stop=None, stop_token_ids=None).stop == () == SamplingParams().stop_token_ids
    with pytest.raises(TypeError):
        SamplingParams(2)  # vLLM's first field is n: positional arguments would mean something else here
    sp = SamplingParams(max_tokens=3, temperature=0.5)
    assert sp.clone(max_tokens=5) == SamplingParams(max_tokens=5, temperature=0.5) and sp.max_tokens == 3
    with pytest.raises(ValueError, match="max_tokens"):
        sp.clone(max_tokens=0)


def test_a_tuple_of_sampling_params_is_one_per_prompt(llm: LLM) -> None:
    outs = llm.generate(["Hello", "The capital"], (SamplingParams(max_tokens=2), SamplingParams(max_tokens=3)))
    assert [len(o.token_ids) for o in outs] == [2, 3]


def test_llm_takes_vllms_dtype_max_model_len_and_seed() -> None:
    short = LLM(dtype="auto", max_model_len=64, seed=3)
    with pytest.raises(ValueError, match="limit of 63"):
        short.generate("Hello " * 70)
    out = short.generate("Hello", SamplingParams(max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 64 - len(out.prompt_token_ids) and out.finish_reason == "length"
    drawn = short.generate("Hello", SamplingParams(temperature=1.0, max_tokens=8))[0].token_ids  # no seed of its own
    again = LLM(seed=3).generate("Hello", SamplingParams(temperature=1.0, max_tokens=8))[0].token_ids
    assert drawn == again
    with pytest.raises(ValueError, match=r"max_model_len: expected an integer in \[2, "):
        LLM(max_model_len=10**9)
    with pytest.raises(ValueError, match="downloads nothing"):
        LLM("Qwen/Qwen3-0.6B")
    with pytest.raises(ValueError, match=r"seed: expected an integer in \[-2\*\*63, 2\*\*64\)"):
        LLM(seed=2**64)  # torch's "Overflow when unpacking long long" named nothing
    with pytest.raises(ValueError, match="model: empty path"):
        LLM("")


def test_a_lone_surrogate_is_refused_by_name_wherever_text_is_taken(llm: LLM) -> None:
    """No UTF-8 text holds one: the tokenizer failed with a TypeError about its input types, and the
    choices' and the grammar's encoding with a UnicodeEncodeError naming no field."""
    lone = "\ud800"
    calls = [(lambda: llm.generate([["a document", "Where?" + lone]]), r"prompts\[0\]\.segments\[1\]"),
             (lambda: llm.chat([{"role": "user", "content": lone}]), r"segments\[0\]"),
             (lambda: llm.prewarm([lone]), r"documents\[0\]"), (lambda: llm.tokenize(lone), r"segments\[0\]"),
             (lambda: llm.generate("Hello", cache_salt=lone), "cache_salt"),
             (lambda: SamplingParams(stop=[lone]), "stop"), (lambda: SamplingParams(bad_words=[lone]), "bad_words"),
             (lambda: SamplingParams(choice=["yes", lone]), "choice"),
             (lambda: SamplingParams(grammar=f'root ::= "{lone}"'), "grammar")]
    for call, field in calls:
        with pytest.raises(ValueError, match=f"{field}: a string holds a lone surrogate"):
            call()
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].token_ids


def test_chat_renders_as_vllm_asks_and_as_transformers_renders(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=4)
    hf = llm.get_tokenizer()  # transformers' rendering of the same template: the independent reference
    assert hf.encode("hi there") == llm.tokenize("hi there")[0] and hf.eos_token_id in llm.engine.eos
    for add in (True, False):
        out = llm.chat(MESSAGES, sp, add_generation_prompt=add, use_tqdm=False)[0]
        assert out.prompt == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Mira lives in"}]
    out = llm.chat(prefilled, sp, continue_final_message=True, add_generation_prompt=False)[0]
    rendered = hf.apply_chat_template(prefilled, tokenize=False, continue_final_message=True)
    assert out.prompt == rendered and rendered.endswith("Mira lives in")
    tail = llm.tokenizer.decode(out.prompt_token_ids[-6:], skip_special_tokens=False)
    assert tail.endswith("Mira lives in")  # the model reads no end of turn after it
    for content in ("im", ">", "\n", "The answer is "):  # "im" is in <|im_end|> too: found by its place, not text
        conv = [MESSAGES[1], {"role": "assistant", "content": content}]
        got = llm.chat(conv, sp, continue_final_message=True, add_generation_prompt=False)[0].prompt
        assert got == hf.apply_chat_template(conv, tokenize=False, continue_final_message=True), content
    trim = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    conv = [MESSAGES[1], {"role": "assistant", "content": " Mira lives in "}]  # a template that trims content
    got = llm.chat(conv, sp, chat_template=trim, continue_final_message=True, add_generation_prompt=False)[0].prompt
    assert got.endswith("<|im_start|>assistant\nMira lives in")
    custom = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert llm.chat(MESSAGES, sp, chat_template=custom)[0].prompt == "[You are helpful.][Where does Mira live?]"
    for kwargs, message in [(dict(continue_final_message=True), "not with add_generation_prompt"),
                            (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs: 'tools'"),
                            (dict(chat_template_kwargs={"add_generation_prompt": False}), "add_generation_prompt"),
                            (dict(chat_template="{% for m in messages %"), "chat_template: TemplateSyntaxError"),
                            (dict(add_generation_prompt=1), "add_generation_prompt: expected a boolean")]:
        with pytest.raises(ValueError, match=message):
            llm.chat(MESSAGES, sp, **kwargs)


def test_allowed_token_ids_limit_every_draw(llm: LLM) -> None:
    """vLLM's ``allowed_token_ids``: greedy takes the likeliest of them (here the 2nd and 3rd likeliest
    first tokens, read from the unconstrained logprobs), sampling never leaves them."""
    free = llm.generate("Hello, my name is", SamplingParams(max_tokens=1, logprobs=5))[0]
    ranked = sorted(free.logprobs[0], key=free.logprobs[0].get, reverse=True)
    only = llm.generate("Hello, my name is", SamplingParams(max_tokens=1, allowed_token_ids=ranked[1:3]))[0]
    assert only.token_ids == [ranked[1]]
    allowed = [ranked[2], ranked[4], 15, 261]
    drawn = llm.generate("Hello, my name is", SamplingParams(n=4, max_tokens=6, temperature=1.5, seed=2,
                                                             allowed_token_ids=allowed))[0]
    assert all(t in allowed for c in drawn.outputs for t in c.token_ids)
    assert len({t for c in drawn.outputs for t in c.token_ids}) > 1
    with pytest.raises(ValueError, match="allowed_token_ids: token id"):
        llm.generate("Hello", SamplingParams(allowed_token_ids=[llm.vocab_size]))
    for bad in ([], [-1], "12"):
        with pytest.raises(ValueError, match="allowed_token_ids: expected a non-empty list"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids: not with json_schema"):
        SamplingParams(allowed_token_ids=[1], json_schema=True)


@pytest.mark.gpu
def test_on_a_gpu_n_answers_allowed_ids_and_a_continued_message_run_as_on_the_cpu(llm: LLM) -> None:
    """The same paths on the device (the draw, the allowed-ids mask and the prompt built on CUDA):
    answer i is the run seeded seed + i there too, sampling stays in the allowed ids, and a continued
    assistant message renders as on the CPU and is continued greedily."""
    gpu = LLM(device="cuda", dtype="float32")
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)
    out = gpu.generate("Hello, my name is", sp)[0]
    for i, c in enumerate(out.outputs):
        assert c.token_ids == gpu.generate("Hello, my name is", sp.clone(n=1, seed=5 + i))[0].token_ids
    free = gpu.generate("Hello, my name is", SamplingParams(max_tokens=1, logprobs=5))[0]
    ranked = sorted(free.logprobs[0], key=free.logprobs[0].get, reverse=True)
    assert gpu.generate("Hello, my name is", SamplingParams(max_tokens=1, allowed_token_ids=ranked[1:3]))[0] \
        .token_ids == [ranked[1]]
    allowed = [ranked[2], ranked[4], 15, 261]
    drawn = gpu.generate("Hello, my name is", SamplingParams(n=4, max_tokens=6, temperature=1.5, seed=2,
                                                             allowed_token_ids=allowed))[0]
    assert all(t in allowed for c in drawn.outputs for t in c.token_ids)
    prefilled = [*MESSAGES, {"role": "assistant", "content": "Mira lives in"}]
    kw = dict(continue_final_message=True, add_generation_prompt=False)
    on_gpu = gpu.chat(prefilled, SamplingParams(max_tokens=4), **kw)[0]
    on_cpu = llm.chat(prefilled, SamplingParams(max_tokens=4), **kw)[0]
    assert on_gpu.prompt == on_cpu.prompt and on_gpu.prompt_token_ids == on_cpu.prompt_token_ids
    assert on_gpu.token_ids == on_cpu.token_ids


def test_the_library_chats_without_the_servers_packages() -> None:
    """``LLM.chat`` renders with the server's templating but needs none of its web packages (the GPU
    machine has no pydantic or FastAPI): a fresh interpreter with them blocked chats and continues."""
    import subprocess
    import sys

    code = ("import sys\nfor m in ('pydantic', 'fastapi', 'uvicorn', 'starlette'): sys.modules[m] = None\n"
            "from hypic import LLM, SamplingParams\n"
            f"conv = {MESSAGES!r} + [{{'role': 'assistant', 'content': 'Mira lives in'}}]\n"
            "out = LLM().chat(conv, SamplingParams(max_tokens=2), continue_final_message=True,\n"
            "                 add_generation_prompt=False)[0]\n"
            "assert out.prompt.endswith('Mira lives in') and len(out.token_ids) == 2\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_bad_words_are_never_completed(llm: LLM) -> None:
    """vLLM's ``bad_words``: the greedy answer's word banned, the answer changes; no output — greedy
    or sampled — holds a banned word's token sequence contiguously, a one-token word ("Quorvane")
    or a two-token phrase ("is employed", which the same sampling writes unbanned); a grammar that
    needs a banned word wins over the ban."""
    from hypic.engine.bad_words import bad_words

    prompt = "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Where does Mira live?"
    free = llm.generate(prompt, SamplingParams(max_tokens=12))[0]
    assert "Quorvane" in free.text
    one, two = (bad_words(llm.tokenizer, (w,)).sequences[0] for w in ("Quorvane", "is employed"))
    assert len(one) == 1 and len(two) == 2  # the word alone, spelt as after a space (a prefix space)
    # with no space before it (a text's first word) the bundled tokenizer spells it otherwise: banned too
    bare = {llm.tokenizer.decode(list(s)): s for s in bad_words(llm.tokenizer, ("Answer",)).sequences}
    assert set(bare) == {" Answer", "Answer"}
    opener = llm.generate(prompt, SamplingParams(max_tokens=4))[0]
    assert opener.token_ids[1] == bare["Answer"][0]  # the bundled model answers "\nAnswer: …"
    assert "Answer" not in llm.generate(prompt, SamplingParams(max_tokens=4, bad_words=["Answer"]))[0].text

    def holds(ids: list[int], seq: tuple[int, ...]) -> bool:
        return any(tuple(ids[i:i + len(seq)]) == seq for i in range(len(ids) - len(seq) + 1))

    banned = llm.generate(prompt, SamplingParams(max_tokens=12, bad_words=["Quorvane"]))[0]
    assert banned.token_ids != free.token_ids and not holds(banned.token_ids, one)
    echo = "Mira Quorvane Mira Quorvane Mira Quorvane Mira"
    sp = SamplingParams(n=8, max_tokens=12, temperature=1.0, seed=2)
    unbanned = llm.generate(echo, sp)[0].outputs
    assert any(holds(o.token_ids, two) for o in unbanned)
    for o in llm.generate(echo, sp.clone(bad_words=["is employed", "Quorvane"]))[0].outputs:
        assert not holds(o.token_ids, two) and not holds(o.token_ids, one), o.token_ids
    forced = llm.generate(prompt, SamplingParams(max_tokens=8, choice=["Quorvane"], bad_words=["Quorvane"]))[0]
    assert forced.text == "Quorvane"
    for bad in ([""], [" "], ["a", 5], "word"):
        with pytest.raises(ValueError, match="bad_words: expected a list of words"):
            SamplingParams(bad_words=bad)


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens_as_vllm_does() -> None:
    """vLLM's ``SamplingParams(truncate_prompt_tokens=k)``: the prompt's last k tokens (across segments)
    are read and answered as that tail given alone; -1 takes the longest prompt the context reads,
    so a prompt past the context is read cut instead of refused; generate and stream alike."""
    from hypic import LLM, SamplingParams
    from hypic.llm import cut_prompt

    short = LLM(device="cpu", max_model_len=128)
    segments = ["Ann was born in Westerholm in 1931.", "Ben was born in Lorn.", "Where was Ann born?"]
    whole = [t for s in short.tokenize(segments) for t in s]
    for keep in (1, 7, 20, len(whole) + 5):
        out = short.generate([segments], SamplingParams(max_tokens=4, truncate_prompt_tokens=keep), mode="full")[0]
        want = whole[-keep:]
        assert out.prompt_token_ids == want
        assert out.token_ids == short.generate([want], SamplingParams(max_tokens=4), mode="full")[0].token_ids
        streamed = [t for d in short.stream(segments, SamplingParams(max_tokens=4, truncate_prompt_tokens=keep),
                                            mode="full") for t in d.token_ids]
        assert streamed == out.token_ids
    long = [(5 * i) % 900 + 30 for i in range(300)]  # past the 128-token context
    with pytest.raises(ValueError, match="exceed"):
        short.generate([long], SamplingParams(max_tokens=1))
    out = short.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == long[-127:]
    for bad in (0, -2, 128, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            short.generate([long], SamplingParams(max_tokens=1, truncate_prompt_tokens=bad))
    assert cut_prompt([[1, 2], [3, 4, 5]], 4, 128) == [[2], [3, 4, 5]]  # a segment cut keeps its tail
    assert cut_prompt([[1, 2], [3, 4, 5]], 3, 128) == [[3, 4, 5]]  # a segment before the cut left out
