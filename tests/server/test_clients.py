"""What popular clients send, served (from a review of lm-evaluation-harness, the OpenAI Agents SDK,
LangChain, LlamaIndex and vLLM's benchmark against this server): keys other APIs' objects carry inside
messages, ``tools: []`` and reasoning settings on the Responses API, ``stop: []``, the model named by
its path, and a streamed chat's first chunk sent with its first token, not before the prefill."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from hypic import LLM, SamplingParams
from hypic.server import ServerSettings
from hypic.server.chat import ChatTemplate
from hypic.server.prompts import chat_segments
from hypic.server.protocol import ChatRequest
from tests.server.conftest import API_KEY, MODEL, serve

USER = {"role": "user", "content": "Question: who?"}


def _chat(http: httpx.Client, messages: list[dict], **kw) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4,
                                                   "temperature": 0, **kw})


def test_keys_other_apis_put_in_messages_are_ignored_as_vllm_ignores_them(http: httpx.Client) -> None:
    want = _chat(http, [USER]).json()["choices"][0]["message"]["content"]
    lm_eval = [{**USER, "type": "text"}]  # lm-eval's local-chat-completions marks every message so
    assert _chat(http, lm_eval).json()["choices"][0]["message"]["content"] == want
    sdk = [USER, {"role": "assistant", "content": "Mira.", "refusal": None, "annotations": [], "audio": None,
                  "function_call": None}, USER]  # an OpenAI SDK answer dumped back into the history
    assert _chat(http, sdk).status_code == 200
    called = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}, USER]  # a streamed call kept with its index
    assert _chat(http, called).status_code == 200
    parts = [{"role": "user", "content": [{"type": "text", "text": "Question: who?",
                                           "cache_control": {"type": "ephemeral"}}]}]
    assert _chat(http, parts).status_code == 200
    for key, value in (("function_call", {"name": "f", "arguments": "{}"}), ("audio", {"id": "a1"})):
        r = _chat(http, [USER, {"role": "assistant", "content": "x", key: value}, USER])
        assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{key}", r.text
        assert "not supported" in r.json()["error"]["message"]
    typo = _chat(http, [USER], max_token=3)  # the request's own fields stay strict
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "max_token"


def test_an_empty_stop_list_is_no_stop_strings(http: httpx.Client) -> None:
    plain = _chat(http, [USER]).json()["choices"][0]["message"]["content"]
    r = _chat(http, [USER], stop=[])
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == plain


def test_the_responses_api_takes_what_the_agents_sdk_sends(http: httpx.Client) -> None:
    base = {"model": MODEL, "input": [USER], "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0}
    want = http.post("/v1/responses", json=base).json()["output"][-1]["content"][0]["text"]
    sent = {**base, "tools": [], "include": [], "truncation": "auto", "prompt_cache_retention": "24h",
            "reasoning": {"effort": "low", "summary": None}, "text": {"format": {"type": "text"}, "verbosity": "low"}}
    r = http.post("/v1/responses", json=sent)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output"][-1]["content"][0]["text"] == want and body["tools"] == []
    assert body["reasoning"] == {"effort": "low", "summary": None} and body["truncation"] == "auto"
    streamed = http.post("/v1/responses", json={**sent, "stream": True})
    assert streamed.status_code == 200 and '"type": "response.incomplete"' in streamed.text  # 4 tokens: cut
    for extra, param in (({"include": ["web_search_call.action.sources"]}, "include[0]"),
                         ({"reasoning": {"summary": "auto"}}, "reasoning.summary")):
        r = http.post("/v1/responses", json={**base, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "not supported" in r.json()["error"]["message"]
    assert _chat(http, [USER], reasoning_effort="low", verbosity="low").status_code == 200


def test_reasoning_effort_reaches_the_chat_template(llm: LLM) -> None:
    """As vLLM hands it: a template that reads ``reasoning_effort`` (gpt-oss's) renders it."""
    template = ChatTemplate("{{ reasoning_effort or 'unset' }}|{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    settings = ServerSettings()
    for effort, shown in ((None, "unset"), ("high", "high")):
        req = ChatRequest.model_validate({"messages": [USER], "reasoning_effort": effort})
        ids = chat_segments(llm, template, req, settings)
        assert llm.tokenizer.decode([t for s in ids for t in s]).strip().startswith(shown)


def test_the_model_is_found_by_its_path_and_listed_with_its_root(llm: LLM) -> None:
    """``vllm bench serve`` reads ``root``; clients that load the tokenizer from the model's path send
    that path as the model (vLLM serves the --model string)."""
    path = str(llm.loaded.path)
    live = serve(llm, model_aliases=(path,))
    try:
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as h:
            card = h.get("/v1/models").json()["data"][0]
            assert card["id"] == MODEL and card["root"] == path
            ok = h.post("/v1/completions", json={"model": path, "prompt": "hi", "max_tokens": 1})
            assert ok.status_code == 200 and ok.json()["model"] == MODEL
            other = h.post("/v1/completions", json={"model": path + "-not", "prompt": "hi", "max_tokens": 1})
            assert other.status_code == 404
    finally:
        live.stop()
    with pytest.raises(ValueError, match="model_aliases"):
        ServerSettings(model_aliases=["x"])


def test_a_streamed_chat_says_nothing_before_its_first_token(http: httpx.Client, llm: LLM) -> None:
    """The role chunk comes with the first token (vLLM's order): a client timing the first chunk (vLLM's
    benchmark) reads the time to the first token. Held here: nothing may arrive while the engine is
    held, before any prefill."""
    got: list[tuple[float, dict]] = []

    def read() -> None:
        body = {"model": MODEL, "messages": [USER], "max_tokens": 3, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got.append((time.monotonic(), json.loads(line[6:])))

    with llm.engine._lock:  # the prefill cannot start
        reader = threading.Thread(target=read)
        reader.start()
        time.sleep(1.0)
        held = list(got)
        released = time.monotonic()
    reader.join(60)
    assert held == []  # before the fix, the role chunk was out at once
    deltas = [c["choices"][0]["delta"] for _, c in got]
    assert deltas[0] == {"role": "assistant", "content": ""} and "content" in deltas[1]
    assert got[0][0] >= released


def test_the_library_reads_an_empty_stop_list_as_none(llm: LLM) -> None:
    assert SamplingParams(stop=[]).stop == ()


def test_a_server_limit_names_the_flag_that_raises_it(http: httpx.Client) -> None:
    """lm-eval's aime asks 32 768 tokens, a batch of 64 prompts is its batch_size 64: what to raise."""
    for body, flag in (({"prompt": "hi", "max_tokens": 10**6}, "--max-completion-tokens"),
                       ({"prompt": ["hi"] * 64, "max_tokens": 1}, "--max-prompts"),
                       ({"prompt": "hi", "max_tokens": 1, "n": 64}, "--max-choices")):
        r = http.post("/v1/completions", json={"model": MODEL, **body})
        assert r.status_code == 400 and f"(hypic serve {flag})" in r.json()["error"]["message"], r.text


def test_vllms_structured_outputs_constrain_as_response_format(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"model": MODEL, "prompt": "Answer in JSON:", "max_tokens": 24, "temperature": 0}
    want = http.post("/v1/completions", json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).json()["choices"][0]["text"]
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert json.loads(want) is not None and free != want  # the constraint acts
    for extra in ({"structured_outputs": {"json": schema}}, {"structured_outputs": {"json": json.dumps(schema)}},
                  {"guided_json": schema}):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (extra, r.text)
    obj = http.post("/v1/completions", json={**body, "structured_outputs": {"json_object": True}})
    fmt = http.post("/v1/completions", json={**body, "response_format": {"type": "json_object"}})
    assert obj.status_code == 200 and obj.json()["choices"][0]["text"] == fmt.json()["choices"][0]["text"]
    assert obj.json()["choices"][0]["text"].startswith("{")
    for extra, param in (({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
                         ({"guided_choice": []}, "guided_choice"),
                         ({"guided_json": schema, "structured_outputs": {"json": schema}}, "guided_json"),
                         ({"structured_outputs": {"json": "{no"}}, "structured_outputs"),
                         ({"guided_json": {"type": "string", "format": "idn-hostname"}}, "guided_json")):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), (extra, r.text)


def test_structural_tags_by_either_name_constrain_as_offline(http: httpx.Client, llm: LLM) -> None:
    """vLLM's ``response_format: {"type": "structural_tag", ...}`` and ``structured_outputs.structural_tag``
    (its JSON text) answer as ``SamplingParams(structural_tag=...)`` offline: here every "e" the
    answer writes opens an integer (the test model writes many); bad tags are 400s naming where."""
    tags = {"triggers": ["e"], "structures": [{"begin": "e", "schema": {"type": "integer"}, "end": ""}]}
    base = {"model": MODEL, "prompt": "Tell me about the sea.", "max_tokens": 32, "temperature": 1.0}
    opened = 0
    for seed in range(3):
        body = {**base, "seed": seed}
        want = llm.generate(body["prompt"], SamplingParams(max_tokens=32, temperature=1.0, seed=seed,
                                                           structural_tag=tags))[0].text
        xgrammars = {"type": "triggered_tags", "triggers": ["e"], "tags": [
            {"begin": "e", "content": {"type": "json_schema", "json_schema": {"type": "integer"}}, "end": ""}]}
        for extra in ({"response_format": {"type": "structural_tag", **tags}},
                      {"structured_outputs": {"structural_tag": json.dumps(tags)}},
                      {"response_format": {"type": "structural_tag", "format": xgrammars}}):
            r = http.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (extra, r.text)
        assert all(re.match(r"-?\d", want[i + 1:]) or want[i + 1:] in ("", "-") for i in range(len(want))
                   if want[i] == "e")
        opened += want.count("e")
        free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert free != want
    assert opened > 0
    # a format tree: a think tag of free text, then one of two fixed answers and a number
    tree = {"type": "sequence", "elements": [
        {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
        {"type": "or", "elements": [{"type": "const_string", "value": " yes "},
                                    {"type": "const_string", "value": " no "}]},
        {"type": "regex", "pattern": "[0-9]{1,3}"}]}
    want = llm.generate(base["prompt"], SamplingParams(max_tokens=32, temperature=1.0, seed=5, structural_tag={
        "type": "structural_tag", "format": tree}))[0].text
    assert want.startswith("<think>")
    for extra in ({"response_format": {"type": "structural_tag", "format": tree}},
                  {"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": tree})}}):
        r = http.post("/v1/completions", json={**base, "seed": 5, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (extra, r.text)
    for extra, param in (({"response_format": {"type": "structural_tag", "triggers": ["x"],
                                               "structures": tags["structures"]}}, "response_format.structures[0]"),
                         ({"response_format": {"type": "structural_tag", "triggers": ["e"], "structures": [
                             {"begin": "e", "schema": {"type": "nope"}, "end": ""}]}},
                          "response_format.structures[0].schema"),
                         ({"structured_outputs": {"structural_tag": "{no"}}, "structured_outputs.structural_tag"),
                         ({"response_format": {"type": "structural_tag", "format": {"type": "or", "elements": []}}},
                          "response_format.format.elements"),
                         ({"response_format": {"type": "structural_tag", "format": {"type": "sequence", "elements": [
                             {"type": "regex", "pattern": "a("}]}}}, "response_format.format.elements[0].pattern"),
                         ({"response_format": {"type": "structural_tag", "format": {}, **tags}},
                          "response_format.structures"),
                         ({"response_format": {"type": "structural_tag", "triggers": ["e"]}},
                          "response_format.structures"),
                         ({"response_format": {"type": "structural_tag", "structures": tags["structures"]}},
                          "response_format.triggers"),
                         ({"response_format": {"type": "json_object", "triggers": ["e"]}}, "response_format.triggers"),
                         ({"response_format": {"type": "structural_tag", **tags}, "guided_regex": "a"},
                          "guided_regex")):
        r = http.post("/v1/completions", json={**base, **extra})
        got = r.json()["error"]["param"]
        assert r.status_code == 400 and (got == param or got.startswith((param + ".", param + "["))), (extra, r.text)


def test_vllms_choice_and_regex_constrain_the_whole_answer(http: httpx.Client) -> None:
    """``structured_outputs.choice`` / ``regex`` (and the older ``guided_choice`` / ``guided_regex``):
    every answer — sampled, whole or streamed, completions or chat — is one of the choices or matches
    the expression whole; refusals name the field the request used."""
    choices = ["positive", "negative", "neutral (maybe?)"]
    pattern = r"[A-Z][a-z]+ lives in [A-Z][a-z]+\."
    base = {"model": MODEL, "max_tokens": 24, "temperature": 1.0}
    for k, extra in enumerate(({"structured_outputs": {"choice": choices}}, {"guided_choice": choices})):
        for route, body in (("/v1/completions", {"prompt": "Review: great film. Sentiment:"}),
                            ("/v1/chat/completions", {"messages": [USER]})):
            r = http.post(route, json={**base, **body, **extra, "seed": k, "n": 3})
            texts = [c["text"] if "text" in c else c["message"]["content"] for c in r.json()["choices"]]
            assert r.status_code == 200 and all(t in choices for t in texts), (route, r.text)
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        r = http.post("/v1/completions", json={**base, "prompt": "Profile of Mira. Mira lives in Quorvane.", "n": 2,
                                                "seed": 5, **extra})
        for c in r.json()["choices"]:
            assert re.fullmatch(pattern, c["text"]) or c["finish_reason"] == "length", c
        lines = http.post("/v1/completions", json={**base, "prompt": "Mira", "stream": True, "seed": 5,
                                                    **extra}).text.splitlines()
        streamed = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {"))
        whole = http.post("/v1/completions", json={**base, "prompt": "Mira", "seed": 5, **extra}).json()
        assert streamed == whole["choices"][0]["text"]
    for extra, param, words in (
            ({"guided_regex": "(?=a)"}, "guided_regex", "look-arounds"),
            ({"structured_outputs": {"regex": "a{3,1}"}}, "structured_outputs", "repetition must be ordered"),
            ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "not with guided_regex"),
            ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "one constraint"),
            ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "one constraint")):
        r = http.post("/v1/completions", json={**base, "prompt": "hi", **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"].startswith(param) and words in error["message"], r.text


def test_vllms_grammar_constrains_the_whole_answer(http: httpx.Client) -> None:
    """``structured_outputs.grammar`` / ``guided_grammar`` (GBNF, or Lark's notation): every answer,
    whole or streamed, is derived from the grammar (or, cut by max_tokens, begins one); refusals name
    the field and the place."""
    from hypic.engine.structured import compile_grammar
    from hypic.engine.structured.matcher import accepts, advance_bytes, start

    gbnf = 'root ::= name " lives in " name "."\nname ::= [A-Z] [a-z]{1,10}'
    lark = 'start: NAME "lives in"i NAME "."\nNAME: "A".."Z" /[a-z]{1,10}/\n%ignore " "'
    base = {"model": MODEL, "max_tokens": 24, "temperature": 1.0}
    for k, (grammar, extra) in enumerate(((gbnf, {"structured_outputs": {"grammar": gbnf}}),
                                          (gbnf, {"guided_grammar": gbnf}),
                                          (lark, {"structured_outputs": {"grammar": lark}}))):
        node = compile_grammar(grammar)
        for route, body in (("/v1/completions", {"prompt": "Profile of Mira. Mira lives in Quorvane."}),
                            ("/v1/chat/completions", {"messages": [USER]})):
            r = http.post(route, json={**base, **body, **extra, "seed": k, "n": 3})
            assert r.status_code == 200, r.text
            for c in r.json()["choices"]:
                text = c["text"] if "text" in c else c["message"]["content"]
                assert accepts(node, text.encode()) if c["finish_reason"] == "stop" else \
                    advance_bytes(start(node), text.encode()) is not None, (route, c)
        lines = http.post("/v1/completions", json={**base, "prompt": "Mira", "stream": True, "seed": 5,
                                                    **extra}).text.splitlines()
        streamed = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {"))
        whole = http.post("/v1/completions", json={**base, "prompt": "Mira", "seed": 5, **extra}).json()
        assert streamed == whole["choices"][0]["text"]
    for extra, param, words in (
            ({"guided_grammar": "root ::= a \"x\" | \"b\"\na ::= root \"y\""}, "guided_grammar", "reaches itself"),
            ({"guided_grammar": "start: \"a\"\n%declare X"}, "guided_grammar", "Lark: %declare is not read"),
            ({"structured_outputs": {"grammar": "root ::= \"a"}}, "structured_outputs.grammar", "line 1"),
            ({"guided_grammar": "root ::= \"a\"", "guided_regex": "a"}, "guided_grammar", "one constraint")):
        r = http.post("/v1/completions", json={**base, "prompt": "hi", **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"].startswith(param) and words in error["message"], r.text


def test_vllms_bad_words_keep_a_word_out_of_the_answer(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Profile of Mira. Mira lives in Quorvane.<<PIC_SEP>>Where does Mira live?",
            "max_tokens": 12, "temperature": 0}
    free = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    word = free.split()[1]  # a word of the greedy answer, banned: the answer changes (the library's
    banned = http.post("/v1/completions", json={**body, "bad_words": [word]})  # test checks the tokens)
    assert banned.status_code == 200 and banned.json()["choices"][0]["text"] != free, (word, banned.text)
    r = http.post("/v1/completions", json={**body, "bad_words": [""]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("bad_words"), r.text


def test_vllms_other_fields_are_taken_or_refused_in_words(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    mine = http.post("/v1/completions", json={**body, "request_id": "abc-1", "priority": 0})
    assert mine.status_code == 200 and mine.json()["id"] == "cmpl-abc-1" and mine.headers["x-request-id"] == "abc-1"
    header = http.post("/v1/chat/completions", headers={"X-Request-Id": "bench-7"},
                       json={"model": MODEL, "messages": [USER], "max_tokens": 2, "stream": True,
                             "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert header.headers["x-request-id"] == "bench-7" and '"id": "chatcmpl-bench-7"' in header.text
    for extra, param, why in (({"priority": 1}, "priority", "first come"),
                              ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "number of tokens"),
                              ({"use_beam_search": True, "stream": True}, "stream", "beam"),
                              ({"use_beam_search": True, "logprobs": 2}, "logprobs", "beam"),
                              ({"use_beam_search": True, "stop": ["x"]}, "stop", "log-probabilities"),
                              ({"use_beam_search": True, "logit_bias": {"5": 3}}, "logit_bias", "beam"),
                              ({"use_beam_search": True, "min_tokens": 2}, "min_tokens", "beam"),
                              ({"request_id": "é"}, "request_id", "")):
        r = http.post("/v1/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert why in r.json()["error"]["message"]


def test_messages_prewarmed_are_the_segments_a_chat_with_a_system_prompt_reads(llm: LLM) -> None:
    """A template with a preamble (Qwen2.5's default system prompt when none is sent): the documents
    are cached as they read behind a system prompt, not with the preamble glued to the first."""
    from hypic.server.prompts import message_segments

    template = ChatTemplate("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n"
                            "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    docs = [{"role": "user", "content": "Mira lives in Quorvane."}, {"role": "user", "content": "Tal plays the harp."}]
    settings = ServerSettings()
    warmed = message_segments(llm, template, [ChatRequest.model_validate({"messages": docs}).messages[i]
                                             for i in range(2)], None, settings)
    assert [m for m, _ in warmed] == [0, 1]
    asked = ChatRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."}, *docs[::-1], USER]})
    read = chat_segments(llm, template, asked, settings)
    assert all(ids in read for _, ids in warmed)
    own = ChatRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."}, *docs]})
    mine = message_segments(llm, template, own.messages, None, settings)  # its own system prompt, first
    assert [m for m, _ in mine] == [0, 1, 2] and mine[0][1] == read[0]


def test_fixes_from_the_diff_review(http: httpx.Client, llm: LLM) -> None:
    """allowed_token_ids that can only end the output under min_tokens is a 400 naming it (it drew
    tokens outside the set, or a 500); an empty structured_outputs constrains nothing (and blocks no
    response_format); an echo-only completion takes the client's id; a header id that is not visible
    ASCII is left unused; a refusal names the field the constraint came in."""
    eos = sorted(llm.engine.eos)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "min_tokens": 2,
                                           "allowed_token_ids": eos, "logprobs": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    with pytest.raises(ValueError, match="allowed_token_ids: every allowed token ends the output"):
        llm.generate("hi", SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=eos))
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}
    both = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                              "response_format": fmt, "structured_outputs": {"json_object": False}})
    assert both.status_code == 200, both.text
    named = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "min_tokens": 1,
                                               "guided_json": {"type": "integer"}})
    assert named.status_code == 400 and "not with guided_json" in named.json()["error"]["message"], named.text
    echo = http.post("/v1/completions", headers={"X-Request-Id": "ll-1"},
                     json={"model": MODEL, "prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 0})
    assert echo.json()["id"] == "cmpl-ll-1" and echo.headers["x-request-id"] == "ll-1"
    odd = http.post("/v1/completions", headers={"X-Request-Id": "a b"}, json={"model": MODEL, "prompt": "hi",
                                                                             "max_tokens": 1})
    assert odd.status_code == 200 and " " not in odd.json()["id"] and odd.headers["x-request-id"] != "a b"
    resp = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2})
    assert "x-request-id" not in resp.headers and resp.json()["id"].startswith("resp_")


def test_n_answers_share_one_scoring_and_hold_no_cycle(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import hypic.engine.engine as engine_module

    scored = []
    real = engine_module.score_prompts
    monkeypatch.setattr(engine_module, "score_prompts", lambda *a, **k: scored.append(len(a[2])) or real(*a, **k))
    out = llm.generate("Hello there", SamplingParams(n=3, max_tokens=2, prompt_logprobs=1, temperature=1.0, seed=1))[0]
    assert sum(scored) == 1  # the prompt scored once, by the first answer
    assert all(o.prompt_logprobs == out.prompt_logprobs is not None for o in out.outputs)
    assert dataclasses.asdict(out)["others"][1]["index"] == 2  # no cycle: asdict walks it


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(http: httpx.Client) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (monitoring scripts read tokens/s off it)."""
    body = {"model": MODEL, "messages": [USER], "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True}
    lines = http.post("/v1/chat/completions", json=body).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    counted = [c["usage"] for c in chunks if c["choices"]]
    final = chunks[-1]["usage"]
    assert len(counted) == len([c for c in chunks if c["choices"]]) >= 2
    assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in counted)
    done = [u["completion_tokens"] for u in counted]
    assert done == sorted(done) and done[-1] == final["completion_tokens"] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in counted)


def test_priority_scheduling_takes_a_request_s_priority(llm: LLM) -> None:
    """With ``--scheduling-policy priority`` a request's priority is taken (completions, chat, and the
    Responses API, which passes it on); the default server refuses any but 0 (above)."""
    live = serve(llm, scheduling_policy="priority")
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [USER], "max_tokens": 2}),
                               ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
                r = http.post(path, json={"model": MODEL, **body, "priority": -3})
                assert r.status_code == 200, r.text
    finally:
        live.stop()
    fcfs = serve(llm)
    try:
        with httpx.Client(base_url=fcfs.url, timeout=60) as http:
            r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "priority": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    finally:
        fcfs.stop()


def test_vllms_beam_search_answers_the_library_s_beams(http: httpx.Client, model_dir) -> None:
    """``use_beam_search`` with n = 3: the choices are the three beams the library's LLM.beam_search
    keeps (a model of its own: the server's runs in its serving loop), best first, on the completions
    and the chat routes."""
    from hypic import BeamSearchParams

    prompt = "Profile of Mira. Mira lives in Quorvane and keeps bees.<<PIC_SEP>>Where does Mira live?"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "n": 3,
                                           "use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5})
    assert r.status_code == 200, r.text
    body = r.json()
    want = LLM(str(model_dir), device="cpu").beam_search(
        prompt, BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5))[0]
    assert [c["text"] for c in body["choices"]] == [b.text for b in want.sequences]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and body["usage"]["completion_tokens"] == 15
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 3, "n": 2,
                                                   "use_beam_search": True})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 2 and chat.json()["object"] == "chat.completion"
    assert all(c["message"]["role"] == "assistant" for c in chat.json()["choices"])


def test_a_beam_search_whose_client_leaves_stops(http: httpx.Client, server) -> None:
    """The search's steps are requests of the serving loop: a client that hangs up mid-search cancels
    the step running and starts no other (counted as cancelled), and the loop is left idle."""
    from tests.server.conftest import API_KEY
    from tests.server.test_lifecycle import wait_for
    from tests.server.test_openai import scrape

    before = scrape(http)
    # 64 steps of 8 beams, each recomputing a long query: seconds, where the client waits 0.1 s
    query = "Mira keeps bees on the roof and walks to the market every morning. " * 40 + "Where does Mira live?"
    body = {"model": MODEL, "prompt": query, "max_tokens": 64, "n": 8, "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(60, read=0.1))

    def settled() -> bool:
        now = scrape(http)
        return (now['hypic_errors_total{kind="cancelled"}'] > before.get('hypic_errors_total{kind="cancelled"}', 0)
                and now["hypic_queue_depth"] == 0 and now["hypic_running_requests"] == 0)
    wait_for(settled, timeout=20)


def test_a_beam_search_wider_than_the_server_can_ever_queue_is_a_400(llm: LLM) -> None:
    live = serve(llm, max_queue=1, max_concurrent=1)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 3,
                                                   "use_beam_search": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            assert "max_queue + max_concurrent" in r.json()["error"]["message"]
    finally:
        live.stop()
