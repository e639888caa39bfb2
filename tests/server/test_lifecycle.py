"""The engine loop as a client sees it: a full queue (429 + Retry-After), request timeouts,
cancellation when the client disconnects, graceful shutdown, and ``hypic serve`` itself."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from hypic import LLM
from tests.server.conftest import serve

LONG = 2000  # tokens: ~15 s of decoding, so only cancellation ends such a request within a test


@pytest.fixture(scope="module")
def endless(model_dir: Path) -> LLM:
    """The served model with no end-of-sequence token: a request runs until max_tokens or cancellation."""
    llm = LLM(str(model_dir), device="cpu")
    llm.engine.eos = set()
    return llm


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"prompt": "Profile of Wrenna Jessop.<<PIC_SEP>>Question: who?", "max_tokens": max_tokens,
            "stream": stream, "temperature": 0}


def idle(url: str) -> Callable[[], bool]:
    return lambda: metric(url, "hypic_running_requests") == 0 and metric(url, "hypic_queue_depth") == 0


def test_full_queue_429_and_disconnect_cancels(endless: LLM) -> None:
    live = serve(endless, max_concurrent=1, max_queue=1, max_completion_tokens=LONG)
    try:
        queued: list[httpx.Response] = []
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body(LONG, stream=True), timeout=60) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would hang up
            assert r.status_code == 200 and next(lines).startswith("data: ")  # running, streaming
            waiter = threading.Thread(target=lambda: queued.append(
                httpx.post(f"{live.url}/v1/completions", json=body(2), timeout=60)))
            waiter.start()
            wait_for(lambda: metric(live.url, "hypic_queue_depth") == 1)
            full = httpx.post(f"{live.url}/v1/completions", json=body(2), timeout=60)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["type"] == "rate_limit_error"
        waiter.join(30)  # leaving the stream hung up: the long request is cancelled, the queued one runs
        assert queued[0].status_code == 200 and queued[0].json()["usage"]["completion_tokens"] == 2
        wait_for(idle(live.url))
        assert metric(live.url, 'hypic_errors_total{kind="cancelled"}') == 1
        assert metric(live.url, 'hypic_errors_total{kind="overloaded"}') == 1
        before = metric(live.url, "hypic_generated_tokens_total")
        with pytest.raises(httpx.ReadTimeout):  # a whole (non-streamed) answer whose client gives up
            httpx.post(f"{live.url}/v1/completions", json=body(LONG), timeout=1.0)
        wait_for(idle(live.url))
        assert metric(live.url, 'hypic_errors_total{kind="cancelled"}') == 2
        assert metric(live.url, "hypic_generated_tokens_total") - before < LONG / 2
        assert endless.engine.store.check_integrity() and not endless.engine.store._pins  # nothing left pinned
    finally:
        live.stop()


def test_n_choices_are_queued_all_or_none(endless: LLM) -> None:
    """Each choice is a request: n = 3 behind a running request with room for two waiting is refused
    whole (429), and the two choices it had queued are taken back; n = 2 then fits and completes."""
    live = serve(endless, max_concurrent=1, max_queue=2, max_completion_tokens=LONG)
    try:
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body(LONG, stream=True), timeout=60) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would hang up
            assert r.status_code == 200 and next(lines).startswith("data: ")  # running: the slot is taken
            full = httpx.post(f"{live.url}/v1/completions", json={**body(2), "n": 3}, timeout=60)
            assert full.status_code == 429 and full.json()["error"]["param"] is None
            wait_for(lambda: metric(live.url, "hypic_queue_depth") == 0)  # the queued two were taken back
            done: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: done.append(
                httpx.post(f"{live.url}/v1/completions", json={**body(2), "n": 2}, timeout=60)))
            waiter.start()
            wait_for(lambda: metric(live.url, "hypic_queue_depth") == 2)
        waiter.join(30)  # the long request hung up and cancelled: both choices run
        assert done[0].status_code == 200 and [c["index"] for c in done[0].json()["choices"]] == [0, 1]
        assert done[0].json()["usage"]["completion_tokens"] == 4
        wait_for(idle(live.url))
        assert endless.engine.store.check_integrity() and not endless.engine.store._pins
    finally:
        live.stop()


def test_request_timeout(endless: LLM) -> None:
    live = serve(endless, request_timeout_s=0.5, max_completion_tokens=LONG)
    try:
        r = httpx.post(f"{live.url}/v1/completions", json=body(LONG), timeout=60)
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        events = [line for line in httpx.post(f"{live.url}/v1/completions", json=body(LONG, stream=True),
                                              timeout=60).text.splitlines() if line]
        assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "timeout_error"
        assert events[-1] == "data: [DONE]"
        responses = httpx.post(f"{live.url}/v1/responses", json={"input": "who?", "max_output_tokens": LONG,
                                                                  "stream": True}, timeout=60).text
        assert '"code": "timeout"' in responses and "response.failed" in responses
        wait_for(idle(live.url))
        assert metric(live.url, 'hypic_errors_total{kind="timeout"}') == 3
        assert metric(live.url, 'hypic_errors_total{kind="cancelled"}') == 0  # a timeout is counted once
    finally:
        live.stop()


def test_graceful_shutdown_finishes_in_flight_requests(endless: LLM) -> None:
    live = serve(endless, shutdown_timeout_s=20)
    lines = []
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body(100, stream=True), timeout=60) as r:
        it = r.iter_lines()
        lines.append(next(it))
        live.server.should_exit = True  # what SIGINT/SIGTERM does
        lines.extend(it)
    live.thread.join(30)
    assert not live.thread.is_alive()
    lines = [x for x in lines if x]
    chunks = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and lines[-1] == "data: [DONE]"
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{live.url}/health")
    assert live.app.state.hypic.runner.closing and endless.engine.store.check_integrity()


def test_shutdown_cancels_what_does_not_finish_in_time(endless: LLM) -> None:
    """Past the shutdown timeout an in-flight request is cancelled with an error it reports: a
    stream's last event is that error, then ``[DONE]`` (it was cut mid-body, uvicorn's cancellation
    ahead of the app's), a whole request a 503; and both are counted as such."""
    live = serve(endless, shutdown_timeout_s=1, max_completion_tokens=LONG)
    whole: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
        f"{live.url}/v1/completions", json=body(LONG), timeout=60)))
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body(LONG, stream=True), timeout=60) as r:
        it = r.iter_lines()
        next(it)
        waiter.start()
        wait_for(lambda: metric(live.url, "hypic_running_requests") == 2)
        t0 = time.monotonic()
        live.server.should_exit = True
        lines = [x for x in it if x]
    waiter.join(30)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["error"]["message"] == "the server shut down before the request finished", last
    assert whole["r"].status_code == 503  # cancelled as it ran, not refused from the queue
    assert whole["r"].json()["error"]["message"] == "the server shut down before the request finished"
    live.thread.join(30)
    assert not live.thread.is_alive() and time.monotonic() - t0 < 10
    assert live.app.state.hypic.runner.scheduler.depth == (0, 0)


@pytest.mark.parametrize("drain", [False, True])
def test_queued_requests_at_shutdown_are_refused_at_once_or_drained(endless: LLM, drain: bool) -> None:
    """A request queued behind a running one when the server begins to stop: by default refused at
    once with a 503 and Retry-After (a load balancer sends it to another replica now, not after this
    one's timeout); with ``shutdown_drain`` served once a slot frees (here: the running one's client
    hangs up), within the timeout."""
    live = serve(endless, max_concurrent=1, shutdown_timeout_s=20, shutdown_drain=drain, max_completion_tokens=LONG)
    queued: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
        f"{live.url}/v1/completions", json=body(3), timeout=60)))
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body(LONG, stream=True), timeout=60) as r:
        it = r.iter_lines()  # (kept: a generator dropped closes the stream, and the request is cancelled)
        next(it)
        waiter.start()
        wait_for(lambda: metric(live.url, "hypic_queue_depth") == 1)
        live.server.should_exit = True  # what SIGINT/SIGTERM does
        wait_for(lambda: live.app.state.hypic.runner is not None and live.app.state.hypic.runner.closing)
        waiter.join(1.5)  # the running stream has seconds of decoding left (≈ 6 s in all here)
        assert waiter.is_alive() == drain, queued  # refused at once, or still queued behind the running stream
    waiter.join(30)  # the stream's client hung up: its slot is free
    if drain:
        assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 3
    else:
        assert queued["r"].status_code == 503 and queued["r"].headers["retry-after"] == "1"
        assert queued["r"].json()["error"]["message"] == "the server is shutting down"
    live.thread.join(30)
    assert not live.thread.is_alive()


def test_drained_requests_not_reached_within_the_shutdown_timeout_end_as_the_running_do(endless: LLM) -> None:
    live = serve(endless, max_concurrent=1, shutdown_timeout_s=1, shutdown_drain=True, max_completion_tokens=LONG)
    queued: dict[str, httpx.Response] = {}
    waiter = threading.Thread(target=lambda: queued.setdefault("r", httpx.post(
        f"{live.url}/v1/completions", json=body(3), timeout=60)))
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body(LONG, stream=True), timeout=60) as r:
        it = r.iter_lines()
        next(it)
        waiter.start()
        wait_for(lambda: metric(live.url, "hypic_queue_depth") == 1)
        live.server.should_exit = True
        lines = [x for x in it if x]
    waiter.join(30)
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["message"] == SHUTDOWN_MESSAGE
    assert queued["r"].status_code == 503 and queued["r"].json()["error"]["message"] == SHUTDOWN_MESSAGE
    live.thread.join(30)
    assert not live.thread.is_alive() and live.app.state.hypic.runner.scheduler.depth == (0, 0)


SHUTDOWN_MESSAGE = "the server shut down before the request finished"


def test_hypic_serve_command(model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "HYPIC_API_KEY": "sk-cli"}
    proc = subprocess.Popen([sys.executable, "-m", "hypic.cli", "serve", "--model", str(model_dir), "--port", "0",
                             "--device", "cpu", "--max-concurrent", "2", "--log-level", "warning",
                             "--cold-workers", "1",  # documents prefilled by a worker process as well
                             "--max-prefill-tokens", "4096", "--cache-dir", str(cache),
                             "--warm-up", "on"],  # off by default on the CPU
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # --port 0: the system's choice is announced (it was announced as port 0), and served on
        first = []
        while not (announced := re.search(r" on http://127\.0\.0\.1:(\d+) ", first[-1] if first else "")):
            first.append(proc.stdout.readline())
            assert first[-1] or proc.poll() is None, "".join(first)
        assert int(announced.group(1)) > 0, first[-1]
        assert re.search(r"\(cpu, float32, [0-9.]+ GiB of weights, API key required\)", first[-1]), first[-1]
        url = f"http://127.0.0.1:{announced.group(1)}"

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(f"{url}/health").status_code == 200
            except httpx.ConnectError:
                return False
        wait_for(up, timeout=120)
        # warmed up before listening, and the metrics do not show it: no work, no lookups, nothing cached
        scraped = httpx.get(f"{url}/metrics").text
        for name in ("hypic_recomputed_tokens_total", "hypic_cache_lookup_misses_total",
                     'hypic_cache_entries{tier="device"}', 'hypic_cold_segments_total{rank="0"}'):
            assert re.search(rf"^{re.escape(name)} 0\.0$", scraped, re.M), (name, scraped[-2000:])
        assert httpx.get(f"{url}/v1/models").status_code == 401  # the key came from $HYPIC_API_KEY
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-cli"}, json=body(2), timeout=60)
        assert r.status_code == 200 and r.json()["model"] == model_dir.name
        docs = "<<PIC_SEP>>".join(f"Profile of {name}. {name} lives in a city by the sea and plays the harp."
                                  for name in ("Wrenna Jessop", "Liora Galvost", "Tamsin Orrick"))
        r = httpx.post(f"{url}/v1/completions", headers={"Authorization": "Bearer sk-cli"}, timeout=60,
                       json={**body(2), "prompt": docs + "<<PIC_SEP>>Question: who plays the harp?"})
        assert r.status_code == 200  # three cold documents: LPT gives the worker one of them
        scraped = httpx.get(f"{url}/metrics").text
        assert re.search(r'^hypic_cold_segments_total\{rank="1"\} [1-9]', scraped, re.M)
        assert re.search(r"^hypic_cold_devices 2", scraped, re.M)
        # a second server on the same --cache-dir is refused before it loads a model: each would
        # remove the other's saved entries
        twin = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--model", str(model_dir / "nope"),
                               "--cache-dir", str(cache)], capture_output=True, text=True, timeout=120)
        assert twin.returncode == 2 and f"in use by another hypic process (pid {proc.pid})" in twin.stderr, \
            twin.stderr[-300:]
        proc.send_signal(signal.SIGTERM)  # what systemd, docker stop and Kubernetes send (Ctrl-C: SIGINT, alike)
        assert proc.wait(60) == 0
        # the cache was saved at shutdown (the three documents; under SIGTERM the process once died
        # before saving, rc 143); the next start loads it
        printed = "".join(first) + proc.stdout.read()
        assert re.search(r"hypic serve: warming up: .*\nhypic serve: warmed up in [\d.]+ s \(8 synthetic calls",
                         printed), printed[-500:]
        saved = re.search(r"(\d+) cached segments saved", printed)
        assert saved and int(saved.group(1)) >= 3 and (cache / "manifest.json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    missing = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--model", str(model_dir / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    bad = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--model", str(model_dir), "--device", "cpu",
                          "--max-prefill-tokens", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-prefill-tokens: expected an integer ≥ 1, got 0" in bad.stderr, bad.stderr
    other = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--model", str(model_dir), "--device", "cpu",
                            "--dtype", "bfloat16", "--cache-dir", str(cache)], capture_output=True, text=True,
                           timeout=120)
    assert other.returncode == 2 and "saved for another model configuration or dtype" in other.stderr, other.stderr
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, needle in ((["--port", "70000"], "port number 0–65535"),
                         (["--cache-dir", str(afile)], f"--cache-dir {afile}"),  # found at shutdown, it lost the cache
                         (["--shutdown-timeout", "inf"], "--shutdown-timeout: expected a positive number"),
                         (["--cache-device-bytes", "inf"], "byte count"),
                         (["--api-key", ""], "--api-key: empty")):  # "$UNSET_VAR" served with no key
        refused = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--model", str(model_dir / "nope"),
                                  *args], capture_output=True, text=True, timeout=120)
        # refused before the model is loaded: the folder does not exist, and that is not what is said
        assert refused.returncode == 2 and needle in refused.stderr and "not a directory" not in refused.stderr, \
            (args, refused.stderr[-300:])
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    out = subprocess.run([sys.executable, "-m", "hypic.cli", "run-batch", "--model", str(model_dir), "--device",
                          "cpu", "-i", str(requests), "-o", str(tmp_path / "no" / "out.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "out.jsonl" in out.stderr  # before the batch runs, not after it


def test_startup_pins_the_host_tier_before_any_request(model_dir: Path) -> None:
    """With a device budget (the tier can overflow) the server starts pinning the host tier at
    startup, in the background, instead of at the first demotion under load."""
    from hypic.cache.host_arena import HostArena

    llm = LLM(str(model_dir), device="cpu", cache_device_bytes=1 << 20, cache_host_bytes=1 << 20)
    llm.engine.store.arena = arena = HostArena(4 * 4096, slab_bytes=4096, pin=False)  # a GPU's arena, unpinned
    live = serve(llm)
    try:
        wait_for(lambda: arena.pinned_bytes == 4 * 4096)
        assert httpx.get(f"{live.url}/health").status_code == 200
        llm.engine.store.move_s = 0.25  # what the store's moves add up (tests/cache): exported as a counter
        assert metric(live.url, "hypic_cache_move_seconds_total") == 0.25
    finally:
        live.stop()
    unbounded = LLM(str(model_dir), device="cpu", cache_device_bytes=None)  # nothing can overflow, nothing pinned
    unbounded.engine.store.arena = idle_arena = HostArena(4 * 4096, slab_bytes=4096, pin=False)
    live = serve(unbounded)
    try:
        assert httpx.get(f"{live.url}/health").status_code == 200 and idle_arena._thread is None
    finally:
        live.stop()


def test_the_command_line_names_bad_values_in_one_line(tmp_path: Path) -> None:
    """demo, eval and bench let the library's ValueErrors out as tracebacks, some after a whole run."""
    for args, needle in ((["demo", "--model", str(tmp_path / "nope")], "hypic demo: --model:"),
                         (["eval", "quality", "--n", "0"], "hypic eval: --n: expected at least 1"),
                         (["eval", "deviation", "--out", str(tmp_path / "no" / "dev.md")], "its folder does not exist"),
                         (["bench", "ttft", "--model", str(tmp_path / "nope")], "hypic bench:")):
        r = subprocess.run([sys.executable, "-m", "hypic.cli", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, (args, r.stderr[-400:])


def test_echo_scoring_is_held_like_any_request(endless: LLM, monkeypatch) -> None:
    """Scoring a prompt (echo with logprobs) is bounded by the request's timeout (504), stopped when
    its client leaves, held to the queue's limit while it waits (429) and shown in the gauges; the
    engine serves other requests between its pieces. (It ran to its end whatever happened: three
    abandoned scorings made the next small request wait 8.7 s.) The forward is slowed to 0.05 s a
    piece of 4 tokens, so a 400-token prompt would take 5 s."""
    from hypic.engine import scoring

    monkeypatch.setattr(scoring, "PIECE", 4)
    forwards = []
    real = endless.engine.model.hidden_states

    def slow(*args, **kwargs):
        forwards.append(time.monotonic())
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(endless.engine.model, "hidden_states", slow)
    prompt = " ".join(f"w{i}" for i in range(200))
    echo = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    live = serve(endless, request_timeout_s=1.0, max_queue=1)
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{live.url}/v1/completions", json=echo, timeout=30)
        assert r.status_code == 504 and time.monotonic() - t0 < 3, (r.status_code, time.monotonic() - t0)
        assert metric(live.url, 'hypic_errors_total{kind="timeout"}') == 1
        # a client that leaves: its scoring stops at the next piece
        with socket.create_connection(("127.0.0.1", live.port)) as s:
            payload = json.dumps(echo).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            wait_for(lambda: len(forwards) > 2)
        wait_for(lambda: metric(live.url, 'hypic_errors_total{kind="cancelled"}') == 1)
        n = len(forwards)
        time.sleep(0.3)
        assert len(forwards) <= n + 1  # no more pieces after the one running as it left
        # one scoring runs, one waits (both in the gauges), a third is refused
        results: dict[int, int] = {}

        def send(k: int) -> None:
            results[k] = httpx.post(f"{live.url}/v1/completions", json=echo, timeout=30).status_code

        threads = [threading.Thread(target=send, args=(k,)) for k in range(2)]
        threads[0].start()
        wait_for(lambda: metric(live.url, "hypic_running_requests") == 1)
        threads[1].start()
        wait_for(lambda: metric(live.url, "hypic_queue_depth") == 1)
        assert httpx.post(f"{live.url}/v1/completions", json=echo, timeout=30).status_code == 429
        for t in threads:
            t.join()
        assert sorted(results.values()) == [504, 504]
        # the abandoned round stops at its next piece (0.05 s here), not at its end (5 s): the gauges
        # may show it for that piece after the 504s went out, then drop
        wait_for(idle(live.url), timeout=1.0)
        monkeypatch.undo()
        assert httpx.post(f"{live.url}/v1/completions", json=body(2), timeout=30).status_code == 200
    finally:
        live.stop()


def test_echo_scoring_waiting_or_past_the_shutdown_timeout_ends_as_requests_do(endless: LLM, monkeypatch) -> None:
    """A scorer whose client leaves while it waits for the running one gives up its place at once
    (it held it until its turn came); past the shutdown timeout the running scoring ends with the
    shutdown's 503, not at its own end. The forward is slowed as above: 200 pieces, 10 s."""
    from hypic.engine import scoring

    monkeypatch.setattr(scoring, "PIECE", 4)
    real = endless.engine.model.hidden_states

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(endless.engine.model, "hidden_states", slow)
    echo = {"prompt": " ".join(f"w{i}" for i in range(200)), "max_tokens": 0, "echo": True, "logprobs": 1}
    live = serve(endless, shutdown_timeout_s=1, max_queue=4)
    try:
        first: dict[str, httpx.Response] = {}
        runner = threading.Thread(target=lambda: first.setdefault("r", httpx.post(
            f"{live.url}/v1/completions", json=echo, timeout=60)))
        runner.start()
        wait_for(lambda: metric(live.url, "hypic_running_requests") == 1)
        with socket.create_connection(("127.0.0.1", live.port)) as s:
            payload = json.dumps(echo).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
            wait_for(lambda: metric(live.url, "hypic_queue_depth") == 1)
        wait_for(lambda: metric(live.url, "hypic_queue_depth") == 0, timeout=3)  # left while the first scores
        assert runner.is_alive()  # the first is still scoring
        t0 = time.monotonic()
        live.server.should_exit = True
        runner.join(30)
        r = first["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] == "the server shut down before the request finished"
        assert time.monotonic() - t0 < 6  # the shutdown timeout (1 s) and a piece, not the 10 s scoring
        live.thread.join(30)
        assert not live.thread.is_alive()
    finally:
        if live.thread.is_alive():
            live.stop()


def test_a_second_sigterm_does_not_cut_the_shutdown_save_short(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A supervisor that repeats its SIGTERM while ``hypic serve`` writes the cache at shutdown (seconds
    for a large cache) left the cache unsaved: the signal interrupted the save (KeyboardInterrupt, a
    traceback, exit 1). uvicorn takes a second SIGTERM as the same request; so must the save after it.
    Here the server's run returns at once (as after a SIGTERM) and the save sends itself the second."""
    from hypic import cli
    from hypic.cache import persist
    from hypic.server.serving import HypicServer

    real = persist.save

    def save(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # handled (or not) right here, in this thread
        return real(*args, **kwargs)

    monkeypatch.setattr(HypicServer, "run", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(persist, "save", save)
    cache = tmp_path / "cache"
    before = signal.getsignal(signal.SIGTERM)
    try:
        rc = cli.main(["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0", "--cache-dir", str(cache)])
    except KeyboardInterrupt:
        pytest.fail("the second SIGTERM interrupted the cache's save")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert rc == 0 and (cache / "manifest.json").exists()


def test_cache_routes_past_the_shutdown_timeout_end_as_requests_do(endless: LLM, monkeypatch) -> None:
    """A pre-warm (or an eviction, or a save) still running when the shutdown timeout passes ends
    with the shutdown's 503, as a generation does. It ran on: uvicorn cancelled it ``GRACE_S`` later,
    a 500 and "Exception in ASGI application" in the log. The pre-warm is slowed to 2 s here; its
    thread still finishes (the documents are cached for the save)."""
    real = endless.engine.prewarm

    def slow(*args, **kwargs):
        time.sleep(2.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(endless.engine, "prewarm", slow)
    live = serve(endless, shutdown_timeout_s=0.3)
    try:
        answer: dict[str, httpx.Response] = {}
        doc = "Profile of Wrenna Jessop. She lives in a city by the sea and plays the harp."
        sender = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
            f"{live.url}/v1/segments", json={"segments": [doc]}, timeout=30)))
        sender.start()
        time.sleep(0.3)  # the pre-warm is under way
        t0 = time.monotonic()
        live.server.should_exit = True
        sender.join(30)
        r = answer["r"]
        assert r.status_code == 503 and time.monotonic() - t0 < 1.5, (r.status_code, time.monotonic() - t0)
        assert r.json()["error"]["message"] == "the server shut down before the request finished"
        live.thread.join(30)
        assert not live.thread.is_alive()
    finally:
        if live.thread.is_alive():
            live.stop()
