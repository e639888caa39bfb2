"""A warm request's host work does not grow with the number of cached documents.

On the GPU a warm request is host-bound (docs/benchmarks.md), and every aten op costs the host a
few microseconds; the combine pass used to issue a few ops per cached document in every layer
(a conv-tail copy, summary indexing), ≈ 4 000 of a 32-document request's ≈ 6 300. Counted here on
CPU (hypic.bench.host_ops), CPU-only fallback kernels left out.
"""

from pathlib import Path

import torch

import hypic.engine.engine
from hypic.bench.host_ops import count_ops
from hypic.bench.shapes import SHAPES
from hypic.bench.sites import package_path
from hypic.bench.ttft import RagShape, rag_prompts
from hypic.engine.engine import Engine
from hypic.engine.request import SamplingParams
from hypic.models.random_init import random_model


@torch.no_grad()
def test_warm_request_ops_do_not_grow_with_cached_documents() -> None:
    layers = 4
    loaded = random_model(dict(SHAPES["tiny"], num_hidden_layers=layers), device="cpu", dtype=torch.float32)
    one = [SamplingParams(max_tokens=1)]
    ops = {}
    for docs in (3, 9):
        engine = Engine(loaded, seam=4)
        prompts = rag_prompts(RagShape(docs, 24, 16, 8), loaded.model.vocab_size, 2, seed=docs)
        engine.generate([prompts[0]], one, mode="hypic")  # every document cached
        counter = count_ops(lambda p=prompts[1], e=engine: e.generate([p], one, mode="hypic"))
        ops[docs] = sum(counter.gpu_relevant().values())
        assert sum(counter.sites.values()) > ops[docs] > 0  # the CPU-only kernels are recognised and left out
    per_doc_layer = (ops[9] - ops[3]) / 6 / layers
    assert per_doc_layer < 0.5, f"{ops}: {per_doc_layer:.2f} host ops per cached document and layer"


def torch_like_function(root: Path, source: str, name: str):
    """``name`` from ``source``, compiled as if it were a file of torch in a virtual environment
    inside a checkout folder named ``hypic`` (``git clone …/hypic``, then ``make``)."""
    filename = root / "hypic" / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "_wrapper.py"
    scope: dict = {}
    exec(compile(source, str(filename), "exec"), scope)
    return scope[name], str(filename)


def test_ops_are_attributed_by_the_package_directory_not_a_folder_name(tmp_path: Path) -> None:
    """A frame is hypic's when its file lies in the package: with ``"/hypic/" in filename`` every op
    of a request in such a checkout was counted at torch's own eval_frame.py, and the CPU-only
    filter left nothing out."""
    issue, filename = torch_like_function(tmp_path, "def issue(x):\n    return x + 1\n", "issue")
    assert package_path(filename) is None
    assert package_path(hypic.engine.engine.__file__) == "engine/engine.py"
    x = torch.ones(2)
    counter = count_ops(lambda: issue(x))
    assert dict(counter.sites) == {"(outside hypic)": 1}  # not torch/_wrapper.py's line
