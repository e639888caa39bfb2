"""A synthetic RAG trace for serving benchmarks: a shared document pool, popular documents, bursty arrivals.

Caching pays off in production because a few documents are retrieved again and again, in
whatever order the retriever returns them. The trace models that: a pool of profile documents
over one consistent world, Zipf popularity over the pool (popularity ranks shuffled, so a
document's id says nothing about its rank), Poisson arrivals, and per request a varied number of
documents drawn by popularity without replacement, in retrieval order. Each request's query asks
about a fact in one of its documents, so the same trace also measures answer quality.
"""

import heapq
import random
from dataclasses import dataclass

from hypic.eval.docs import profile
from hypic.eval.tasks import HEAD_QA, Example, readings
from hypic.eval.vocab import ORG_KINDS, ORG_STEMS
from hypic.eval.world import RELATIONS, sample_world, sentence


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds since the trace started
    doc_ids: tuple[int, ...]  # indices into Trace.documents, in retrieval order
    query: str
    answer: str
    support: int  # the doc id whose document answers the query
    # other answers the request's documents support as well (a partnership worded as mutual:
    # tasks.Example.alternatives); scored like `answer`
    alternatives: tuple[str, ...] = ()

    @property
    def references(self) -> tuple[str, ...]:
        return (self.answer, *self.alternatives)


@dataclass(frozen=True)
class Trace:
    head: str
    documents: tuple[str, ...]  # the pool; a doc id is an index here
    requests: tuple[TraceRequest, ...]

    def segments(self, request: TraceRequest) -> list[str]:
        return [self.head, *(self.documents[i] for i in request.doc_ids), request.query]

    def example(self, request: TraceRequest) -> Example:
        """The request as a scored QA example."""
        support = (1 + request.doc_ids.index(request.support),)
        return Example(self.segments(request), request.answer, "rag_trace", "em_f1", support,
                       alternatives=request.alternatives)


def generate_trace(seed: int, num_requests: int = 200, pool_size: int = 256, rate_qps: float = 2.0,
                   zipf_s: float = 1.0, num_docs: tuple[int, int] = (4, 32),
                   doc_tokens: tuple[int, int] = (64, 512)) -> Trace:
    """A deterministic trace: the same arguments give the same pool, arrivals and queries."""
    if pool_size < 2 or num_requests < 0 or rate_qps <= 0 or zipf_s < 0:
        raise ValueError("need pool_size >= 2, num_requests >= 0, rate_qps > 0 and zipf_s >= 0")
    if not 1 <= num_docs[0] <= num_docs[1] or not 1 <= doc_tokens[0] <= doc_tokens[1]:
        raise ValueError(f"num_docs and doc_tokens must be ranges of positive ints, got {num_docs}, {doc_tokens}")
    rng = random.Random(f"trace/{seed}")
    # One world for the whole pool, so facts agree across every request that shares a document.
    n_orgs = min(len(ORG_STEMS) * len(ORG_KINDS), pool_size // 5)
    world = sample_world(rng, pool_size - n_orgs, n_orgs)
    entities = world.people + world.orgs
    rng.shuffle(entities)
    # Each document states at least one fact, so any document can carry a request's query.
    docs = [profile(rng, e, rng.randint(*doc_tokens), required=[rng.choice(list(e.facts))]) for e in entities]
    rank = list(range(pool_size))
    rng.shuffle(rank)
    weight = [1.0 / (r + 1) ** zipf_s for r in rank]  # [pool_size]; rank[d] = 0 is the most popular
    requests, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate_qps)
        k = min(rng.randint(*num_docs), pool_size)
        # Weighted sampling without replacement (Efraimidis–Spirakis, log form): the k smallest
        # Exp(1)/w keys; sorting by key doubles as the retrieval order.
        key = [rng.expovariate(1.0) / w for w in weight]
        doc_ids = tuple(heapq.nsmallest(k, range(pool_size), key=key.__getitem__))
        support = rng.choice(doc_ids)
        entity, rel = entities[support], RELATIONS[rng.choice(docs[support].stated)]
        query = f"Question: {sentence(rng.choice(rel.questions), entity.phrase)}\nAnswer:"
        answer = entity.facts[rel.name]
        others = sorted(readings(entity, rel, [(entities[d], docs[d]) for d in doc_ids]) - {answer})
        requests.append(TraceRequest(t, doc_ids, query, answer, support, tuple(others)))
    return Trace(HEAD_QA, tuple(d.text for d in docs), tuple(requests))
