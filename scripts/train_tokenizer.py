"""Train the task models' byte-level BPE on the synthetic task suite and save tokenizer.json.

    python scripts/train_tokenizer.py --out models/tiny-tok [--vocab-size 2048]

Vocabulary size: 2048 is a cap, not a target. The suite's closed vocabulary (invented names,
templated sentences, filler) is about 650 distinct words, and BPE with every byte in its base
alphabet saturates at about 1.9k entries (each word and every prefix merged on the way to it),
where every word is one token and `approx_tokens` counts tokens exactly. A larger cap adds
nothing; a smaller one (1024) splits words and costs ~30% more tokens per prompt. A vocabulary
that small also keeps the tied embedding of a <= 16M-parameter model near 1.9k x d (0.5M at
d = 256), leaving the parameter budget to the layers.

Special tokens: `<|endoftext|>` (id 0: padding, document separator) and `<|end|>` (id 1: ends a
generated answer; use it as the model's eos_token_id). Also writes tokenizer_config.json naming
them, and prints tokens per example by family and difficulty.
"""

import argparse
import json
import statistics
from pathlib import Path

from hypic.eval.tasks import FAMILIES, generate
from hypic.eval.tokenizer import END, END_OF_TEXT, corpus, encode_example, train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--examples-per-family", type=int, default=20, help="per family, difficulty and seed")
    ap.add_argument("--seeds", type=int, default=5, help="corpus seeds 0..N-1 (evaluation seeds are disjoint)")
    ap.add_argument("--trace-requests", type=int, default=50, help="also train on a trace pool of this many requests")
    args = ap.parse_args()

    # Seeds counted down from -1 keep the corpus apart from evaluation sets drawn with seeds >= 0;
    # the vocabulary is closed, so this changes no token, only keeps the bookkeeping honest.
    seeds = range(-1, -1 - args.seeds, -1)
    tok = train_tokenizer(corpus(args.examples_per_family, seeds, trace_requests=args.trace_requests), args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": END, "pad_token": END_OF_TEXT,
              "add_prefix_space": True}
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"vocab size {tok.get_vocab_size()}; {END_OF_TEXT}={tok.token_to_id(END_OF_TEXT)} "
          f"{END}={tok.token_to_id(END)}; saved to {args.out / 'tokenizer.json'}")

    print(f"{'family':<18} {'difficulty':>10} {'docs':>5} {'tok/doc':>8} {'tok/prompt':>10} {'max':>6} {'answer':>6}")
    for family in FAMILIES:
        for d in (0.0, 0.5, 1.0):
            enc = [encode_example(tok, ex) for ex in generate(family, 100, 10_000, difficulty=d)]
            docs = [len(s) for e in enc for s in e.segments[1:-1]]
            prompts = [sum(map(len, e.segments)) for e in enc]
            print(f"{family:<18} {d:>10.1f} {statistics.mean(len(e.segments) - 2 for e in enc):>5.1f} "
                  f"{statistics.mean(docs):>8.1f} {statistics.mean(prompts):>10.0f} {max(prompts):>6} "
                  f"{statistics.mean(len(e.target) - 1 for e in enc):>6.1f}")


if __name__ == "__main__":
    main()
