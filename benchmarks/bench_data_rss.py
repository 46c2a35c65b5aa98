"""Peak memory of tokenizing and training from a small and a large corpus: it should not grow with the corpus.

    python benchmarks/bench_data_rss.py --gb 2 [--tokenizer PATH|tiny-bpe] [--out-dir /tmp]

Writes two .jsonl corpora of pseudo-random words (20 MB and ``--gb`` GB) under ``--out-dir``, then, for each corpus and
tokenizer (bytes, and ``--tokenizer`` if given: a tokenizer folder, or ``tiny-bpe`` for a 300-token BPE trained here
as the unit tests train one), runs in a fresh child process what a peer does with its data: ``tokenize_to_cache``,
``split_train_val``, 200 ``ShardedBatches`` batches of 16 x 1024 tokens over the training part and ``eval_batches``
over the held-out part. Each child reports its seconds and its peak RSS (``ru_maxrss``); the table compares them.
The corpora and token caches are deleted at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SMALL_BYTES = 20 * 10**6
BLOCK_SIZE, BATCH_SIZE, NUM_BATCHES, EVAL_BATCHES = 1024, 16, 200, 50


def write_corpus(path: Path, num_bytes: int, seed: int = 0) -> None:
    """About ``num_bytes`` of JSON lines {"text": ...}: documents of 20 to ~3000 words drawn from 20,000 made-up
    words with Zipf-like frequencies (so a BPE tokenizer finds something to merge), punctuation included."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    lengths = rng.integers(1, 11, size=20_000)
    words = [bytes(rng.choice(letters, size=n)) for n in lengths] + [b".", b",", b";"]
    weights = 1.0 / (np.arange(len(words)) + 2.7)
    weights[-3:] = [0.05, 0.04, 0.01]  # punctuation, a few per hundred words
    cumulative = np.cumsum(weights / weights.sum())
    vocab = np.array(words, dtype=object)
    written = 0
    with open(path, "wb", buffering=8 << 20) as out:
        while written < num_bytes:
            doc_words = np.clip(rng.lognormal(5.5, 1.0, size=1000).astype(np.int64), 20, 3000)
            ids = np.searchsorted(cumulative, rng.random(int(doc_words.sum())))
            ends = np.cumsum(doc_words)
            lines = [b'{"text": "' + b" ".join(vocab[ids[end - n : end]]) + b'"}\n' for n, end in zip(doc_words, ends)]
            chunk = b"".join(lines)
            out.write(chunk)
            written += len(chunk)


def train_tiny_bpe(corpus: Path, folder: Path) -> None:
    """A 300-token byte-level BPE with an <|endoftext|> token, trained on the first documents of ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(corpus, "rb") as lines:
        texts = [json.loads(line)["text"] for _, line in zip(range(2000), lines)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


def child(corpus: str, tokenizer: str, cache_dir: str) -> None:
    """What a peer does with its data, in this process; prints one JSON line of figures."""
    import torch

    from p2ptrain.data import ShardedBatches, eval_batches, split_train_val
    from p2ptrain.tokens import load_tokenizer, tokenize_to_cache

    torch.set_num_threads(1)
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    tokens = tokenize_to_cache([corpus], load_tokenizer(tokenizer), "text", cache_dir)
    tokenize_s = time.perf_counter() - started
    train, held_out = split_train_val(tokens)
    started = time.perf_counter()
    batches = ShardedBatches(train, BLOCK_SIZE, BATCH_SIZE, shard_index=0, num_shards=1)
    for _ in range(NUM_BATCHES):
        x, _ = next(batches)
        assert x.shape == (BATCH_SIZE, BLOCK_SIZE)
    eval_batches(held_out, BLOCK_SIZE, BATCH_SIZE, EVAL_BATCHES)
    batches_s = time.perf_counter() - started
    print(json.dumps({"tokens": len(tokens), "tokenize_s": tokenize_s, "batches_s": batches_s,
                      "baseline_mb": baseline_kb / 1024,
                      "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def measure(corpus: Path, tokenizer: str, cache_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(corpus), tokenizer, str(cache_dir)],
                         capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the child for {corpus} ({tokenizer}) failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="size of the large corpus, GB")
    parser.add_argument("--out-dir", default="/tmp", help="where the corpora and token caches go")
    parser.add_argument("--tokenizer", help="also measure this tokenizer: a folder, or tiny-bpe")
    parser.add_argument("--keep", action="store_true", help="keep the corpora and caches")
    parser.add_argument("--child", nargs=3, metavar=("CORPUS", "TOKENIZER", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return

    work = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-data-", dir=args.out_dir))
    try:
        corpora = {"small": work / "small.jsonl", "large": work / "large.jsonl"}
        for name, size in (("small", SMALL_BYTES), ("large", int(args.gb * 10**9))):
            started = time.perf_counter()
            write_corpus(corpora[name], size)
            print(f"wrote the {name} corpus, {os.path.getsize(corpora[name]) / 1e6:,.0f} MB, in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
        tokenizers = ["bytes"]
        if args.tokenizer == "tiny-bpe":
            train_tiny_bpe(corpora["small"], work / "tiny-bpe")
            tokenizers.append(str(work / "tiny-bpe"))
        elif args.tokenizer:
            tokenizers.append(args.tokenizer)

        print(f"\n{'tokenizer':<12} {'corpus':<7} {'MB':>7} {'tokens':>14} {'tokenize s':>10} {'MB/s':>7} "
              f"{'batches s':>9} {'RSS after import MB':>19} {'peak RSS MB':>11}")
        for tokenizer in tokenizers:
            peaks = {}
            for name, corpus in corpora.items():
                r = measure(corpus, tokenizer, work / "cache")
                mb = os.path.getsize(corpus) / 1e6
                peaks[name] = r["peak_mb"]
                print(f"{Path(tokenizer).name:<12} {name:<7} {mb:>7,.0f} {r['tokens']:>14,} {r['tokenize_s']:>10.1f} "
                      f"{mb / r['tokenize_s']:>7.1f} {r['batches_s']:>9.2f} {r['baseline_mb']:>19.0f} "
                      f"{r['peak_mb']:>11.0f}", flush=True)
            print(f"{Path(tokenizer).name:<12} peak RSS large - small: {peaks['large'] - peaks['small']:+.0f} MB",
                  flush=True)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work)


if __name__ == "__main__":
    main()
