"""``hypic run-batch``: a file of requests in OpenAI's batch format answered as the server answers
them — the same bodies as over HTTP, in the input's order, documents cached across requests — with
refused requests as responses with their status and lines that are not requests as errors."""

from __future__ import annotations

import json
from pathlib import Path

from openai import OpenAI

from hypic.cli import main
from tests.server.conftest import MODEL

DOCS = ["Profile of Mira. Mira lives in Quorvane and keeps bees on the roof.",
        "Profile of Tal. Tal plays the harp in Westvale every evening."]


def _chat(docs: list[str]) -> dict:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [*({"role": "user", "content": d} for d in docs),
                         {"role": "user", "content": "Question: Where does Mira live?"}]}


def test_a_batch_file_is_answered_as_the_server_answers(model_dir: Path, tmp_path: Path, client: OpenAI) -> None:
    completion = {"model": MODEL, "prompt": f"{DOCS[0]}<<PIC_SEP>>Question: Who keeps bees?", "max_tokens": 4,
                  "temperature": 0}
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": _chat(DOCS)},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": _chat(DOCS[::-1])},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": completion},
        {"custom_id": "d", "method": "POST", "url": "/v1/responses",
         "body": {"model": MODEL, "input": "Who plays the harp?", "max_output_tokens": 3, "temperature": 0}},
        {"custom_id": "e", "method": "POST", "url": "/v1/chat/completions", "body": {**_chat(DOCS), "max_token": 2}},
        {"custom_id": "f", "method": "GET", "url": "/v1/models", "body": {}},
        {"custom_id": "g", "method": "POST", "url": "/v1/embeddings", "body": {}},
        {"custom_id": "h", "method": "POST", "url": "/v1/completions", "body": {**completion, "stream": True}},
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": completion},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # then a line that is not UTF-8 (it once lost the whole batch), and a request whose prompt holds a
    # raw U+2028, which str.splitlines() would have cut in two
    sep = {"custom_id": "i", "method": "POST", "url": "/v1/completions",
           "body": {**completion, "prompt": "Who keeps\u2028bees?"}}
    src.write_bytes(("\n".join(json.dumps(x) for x in lines) + "\n\nnot json\n").encode()
                    + b'{"custom_id": "caf\xe9"}\n' + json.dumps(sep, ensure_ascii=False).encode() + b"\n")
    assert main(["run-batch", "--model", str(model_dir), "--served-model-name", MODEL, "--device", "cpu",
                 "--max-concurrent", "1", "-i", str(src), "-o", str(out)]) == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "b", "c", "d", "e", "f", "g", "h", "a", None, None, "i"]
    assert results[10]["error"]["message"].startswith("line 12: not UTF-8")
    assert results[11]["error"] is None and results[11]["response"]["status_code"] == 200
    results = results[:10]
    ok = {r["custom_id"]: r["response"] for r in results[:4]}
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results[:4])
    want = client.chat.completions.create(**_chat(DOCS)).choices[0].message.content  # the live server's answer
    assert ok["a"]["body"]["choices"][0]["message"]["content"] == want
    assert ok["a"]["request_id"] == ok["a"]["body"]["id"] and results[0]["id"].startswith("batch_req_")
    assert ok["b"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the documents, reordered
    assert ok["c"]["body"]["object"] == "text_completion" and ok["d"]["body"]["object"] == "response"
    refused = results[4]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_token"
    for r, field in zip(results[5:], ("method", "url", "body.stream", "custom_id", "line 11"), strict=True):
        assert r["response"] is None and r["error"]["message"].startswith(field), r


def test_lines_python_reads_but_http_cannot_carry_are_answered_not_fatal(llm) -> None:
    import asyncio

    from hypic.server import ServerSettings, create_app
    from hypic.server.batch import run_batch

    ok = '{"custom_id": "ok", "method": "POST", "url": "/v1/responses", "body": {"input": "hi", "max_output_tokens":1}}'
    lines = [ok, '{"custom_id": "nan", "method": "POST", "url": "/v1/responses", "body": {"input": "hi", '
                 '"temperature": NaN}}',
             '{"custom_id": "surrogate", "method": "POST", "url": "/v1/responses", "body": {"input": "\\ud800"}}',
             "[" * 100_000]
    results, totals = asyncio.run(run_batch(create_app(llm, ServerSettings(model_name=MODEL)), lines, 2))
    assert [r["response"] and r["response"]["status_code"] for r in results] == [200, 400, 400, None]
    assert results[1]["response"]["body"]["error"]["param"] == "temperature"
    assert results[3]["error"]["message"].startswith("line 4: not JSON")


def test_a_batch_larger_than_the_queue_waits_for_room_instead_of_being_refused(llm) -> None:
    """Eight requests of 3 choices each, sent 4 at a time to a server that holds 2 running and 2
    waiting: the queue overflows (a 429 over HTTP), and the batch sends again until each fits."""
    import asyncio

    from hypic.server import ServerSettings, create_app
    from hypic.server.batch import run_batch

    body = {"model": MODEL, "prompt": "Who keeps bees?", "max_tokens": 3, "n": 3, "temperature": 1, "seed": 1}
    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body})
             for i in range(8)]
    app = create_app(llm, ServerSettings(model_name=MODEL, max_concurrent=2, max_queue=2))
    results, totals = asyncio.run(run_batch(app, lines, 4))
    assert [r["response"]["status_code"] for r in results] == [200] * 8 and totals.by_status == {200: 8}
    assert totals.requeued > 0 and all(len(r["response"]["body"]["choices"]) == 3 for r in results)


def test_a_request_larger_than_the_server_can_ever_hold_is_a_400_not_endless_429s(llm) -> None:
    """Eight choices at once on a server of one running and four waiting places: refused with a
    429 at every retry, and run-batch retried for ever."""
    import asyncio

    from hypic.server import ServerSettings, create_app
    from hypic.server.batch import run_batch

    body = {"model": MODEL, "prompt": "Who keeps bees?", "max_tokens": 2, "n": 8}
    lines = [json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": body}),
             json.dumps({"custom_id": "fits", "method": "POST", "url": "/v1/completions", "body": {**body, "n": 5}})]
    app = create_app(llm, ServerSettings(model_name=MODEL, max_concurrent=1, max_queue=4))
    results, totals = asyncio.run(asyncio.wait_for(run_batch(app, lines, 2), timeout=120))
    assert [r["response"]["status_code"] for r in results] == [400, 200]
    assert results[0]["response"]["body"]["error"]["param"] == "n"


def test_a_batch_is_served_with_8_bit_weights(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """``--quantization fp8`` reaches the loader (a spy that calls through) and the answers come."""
    import hypic.llm

    seen, real = [], hypic.llm.load_model
    monkeypatch.setattr(hypic.llm, "load_model", lambda *a, **k: seen.append(k.get("quantization")) or real(*a, **k))
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                               "body": _chat(DOCS)}) + "\n")
    assert main(["run-batch", "--model", str(model_dir), "--served-model-name", MODEL, "--device", "cpu",
                 "--quantization", "fp8", "-i", str(src), "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert seen == ["fp8"] and result["response"]["status_code"] == 200
    assert result["response"]["body"]["usage"]["completion_tokens"] > 0
