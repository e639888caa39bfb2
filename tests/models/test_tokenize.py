"""Encoding with Python's lock released: the same encoding, and other threads run meanwhile."""

import threading
import time

from tokenizers import Tokenizer

from hypic.llm import bundled_model_path
from hypic.models.tokenize import encode


def _tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))


def test_the_encoding_is_the_tokenizers_own() -> None:
    tok = _tokenizer()
    for text in ("Question: which river?", " leading space", "naïve café — ünïcödé 🙂", "a\nb\tc", "x" * 3000):
        for special in (False, True):
            want = tok.encode(text, add_special_tokens=special)
            got = encode(tok, text, add_special_tokens=special)
            assert got.ids == want.ids and got.offsets == want.offsets


def test_other_threads_run_while_a_long_text_is_encoded() -> None:
    """``Tokenizer.encode`` holds the GIL for the whole call: a server's event loop and serving loop
    stood still while a 4 MB prompt was tokenized on a worker thread. Here the main thread must keep
    ticking while another encodes."""
    tok = _tokenizer()
    text = "Tamsin keeps a cat named Rosk in Southfen. " * 40_000  # ≈ 1.7 MB
    done = threading.Event()
    took = []

    def work() -> None:
        t0 = time.perf_counter()
        encode(tok, text)
        took.append(time.perf_counter() - t0)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    ticks = 0
    while not done.is_set():
        time.sleep(0.002)  # gives the lock up; taking it back needs the encoder to have let it go
        ticks += 1
    worker.join()
    assert took[0] > 0.05  # long enough to tell
    assert ticks >= min(10, took[0] / 0.002 / 4), (ticks, took)
