"""A tiny served model (random Qwen3.5 weights, a byte-level BPE tokenizer trained in ~1 s, a
ChatML template) and live servers on free loopback ports, run by uvicorn in a thread."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from openai import OpenAI
from safetensors.torch import load_file, save_file

from hypic import LLM
from hypic.eval.tokenizer import END, corpus, train_tokenizer
from hypic.server import ServerSettings, create_app, serving
from hypic.server.chat import CHATML
from hypic.server.serving import HypicServer
from tests.engine.conftest import _qwen3_5

API_KEY = "sk-hypic-test"
LOGIT_SCALE = 15.0
MODEL = "tiny"


def build_model(path: Path, special: tuple[str, ...] = (), added: tuple[str, ...] = ()) -> Path:
    """``special``: more special tokens; ``added``: more tokens that are text (as Qwen's ``<tool_call>``
    is); both in the vocabulary the model is built for."""
    tok = train_tokenizer(corpus(1, seeds=(-1,), difficulties=(0.5,), trace_requests=20), 1024)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", *special])
    tok.add_tokens(list(added))
    _qwen3_5(path, vocab_size=tok.get_vocab_size(), eos_token_id=tok.token_to_id(END))
    # Random init gives near-uniform logits (top two often within 1e-5): greedy answers would then
    # hinge on fp32 noise. A sharper head makes "the same answer" a meaningful comparison.
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * LOGIT_SCALE
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": END}))
    return path


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 (a port the OS picked) in a background thread, as
    ``hypic serve`` runs it (``hypic.server.serving``)."""

    def __init__(self, app: FastAPI, settings: ServerSettings) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app
        self.server = HypicServer(serving.config(app, settings, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "the test server did not stop"


def serve(llm: LLM, **settings) -> LiveServer:
    s = ServerSettings(**{"model_name": MODEL, "shutdown_timeout_s": 10, **settings})
    return LiveServer(create_app(llm, s), s)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("served_model"))


@pytest.fixture(scope="session")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), device="cpu")


@pytest.fixture(scope="session")
def server(llm: LLM) -> Iterator[LiveServer]:
    """The shared server: an API key, small limits so the limit errors are cheap to reach."""
    live = serve(llm, api_key=API_KEY, max_segments=16, max_prompt_tokens=1024, max_completion_tokens=64,
                 max_concurrent=4, max_queue=32)
    yield live
    live.stop()


def serve_with_template(model_dir: Path, folder: Path, template: str, **settings) -> LiveServer:
    """The shared test model copied into ``folder`` with another chat template, served on its own."""
    shutil.copytree(model_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return serve(LLM(str(folder), device="cpu"), api_key=API_KEY, **settings)


def openai_client(live: LiveServer) -> OpenAI:
    return OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def http_client(live: LiveServer) -> httpx.Client:
    return httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> OpenAI:
    """The shared server through the official client (a module may serve another and override it)."""
    return openai_client(server)


@pytest.fixture(scope="module")
def http(server: LiveServer) -> httpx.Client:
    return http_client(server)
