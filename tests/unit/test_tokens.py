"""Tokenized data: tokenizers, documents from every source format, the token cache, and batches read from it."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from p2ptrain.data import DataError, ShardedBatches, eval_batches, load_corpus, split_train_val
from p2ptrain.tokens import (
    ByteTokenizer,
    TokenFile,
    iter_documents,
    load_tokenizer,
    tokenize_to_cache,
)

WORDS = ["the", "swarm", "trains", "a", "model", "over", "peers", "who", "average", "every", "few", "hundred",
         "steps", "café", "naïve", "日本語", "loss", "falls", "slowly", "then", "faster", "."]


def make_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60))) for _ in range(n)]


DOCS = make_documents(120)  # about 30 KB of text: a few thousand tokens with the small tokenizer below


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: doc}) + "\n" for i, doc in enumerate(docs)))
    return path


def write_parquet(path, docs, field="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=50)
    return path


def write_arrow_file(path, docs):
    """The Arrow IPC file format (Feather v2), not the stream format that Hugging Face datasets write."""
    import pyarrow as pa

    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=40)
    return path


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A tiny byte-level BPE tokenizer (about 300 tokens, <|endoftext|> included) saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


@pytest.fixture
def offline(monkeypatch):
    """The hub is unreachable at once: without this, the Hugging Face libraries retry for a minute first. They read
    HF_HUB_OFFLINE when imported, so the flags they copied it into are set too."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def expected_tokens(tokenizer, docs) -> list[int]:
    tokens: list[int] = []
    for i, ids in enumerate(tokenizer.encode_batch(docs)):
        tokens += (tokenizer.separator if i else []) + ids
    return tokens


def token_file(tmp_path, tokens, dtype="<u2") -> TokenFile:
    path = tmp_path / "tokens.bin"
    np.asarray(tokens, dtype=dtype).tofile(path)
    return TokenFile(path, dtype)


# --- tokenizers ----------------------------------------------------------------------------------------------------


def test_the_byte_tokenizer_is_utf8_with_a_blank_line_between_documents():
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer) and load_tokenizer("bytes").digest == tok.digest == "bytes"
    assert (tok.name, tok.vocab_size, tok.separator) == ("bytes", 256, [10, 10])
    assert tok.encode_batch(["hé", ""]) == [[104, 0xC3, 0xA9], []]
    assert tok.decode([104, 0xC3, 0xA9, 0xFF]) == "hé\ufffd"


def test_a_tokenizer_folder_loads_as_transformers_encodes(bpe_folder):
    from transformers import AutoTokenizer

    tok = load_tokenizer(str(bpe_folder))
    reference = AutoTokenizer.from_pretrained(bpe_folder)
    assert tok.name == str(bpe_folder) and tok.vocab_size == len(reference)
    assert tok.separator == [reference.convert_tokens_to_ids("<|endoftext|>")]
    assert tok.encode_batch(DOCS[:5]) == reference(DOCS[:5], add_special_tokens=False)["input_ids"]
    assert tok.decode(tok.encode_batch(DOCS[:1])[0]) == DOCS[0]
    assert load_tokenizer(str(bpe_folder)).digest == tok.digest != "bytes"  # by content: the same on every peer


def test_a_tokenizer_without_end_of_text_token_separates_nothing_and_says_so(tmp_path, bpe_folder, caplog):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = AutoTokenizer.from_pretrained(bpe_folder).backend_tokenizer
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(str(tmp_path))
    assert tok.separator == [] and "no end-of-text or separator token" in caplog.text
    assert tok.digest != load_tokenizer(str(bpe_folder)).digest


def test_a_hub_tokenizer_without_internet_is_a_one_line_error(offline, tmp_path):
    with pytest.raises(DataError, match=r"^--tokenizer openai-community/gpt2: not a folder here and the Hugging Face "
                                        r"hub cannot be reached.*; pass a local tokenizer folder$"):
        load_tokenizer("openai-community/gpt2")
    with pytest.raises(DataError, match=r"^--tokenizer \S+missing: not a folder here.*pass a local tokenizer folder"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(DataError, match=r"cannot load a tokenizer from this folder.*tokenizer\.json"):
        load_tokenizer(str(tmp_path))  # a folder, but no tokenizer in it


def test_missing_hf_packages_name_the_pip_command(monkeypatch, tmp_path):
    parquet = str(write_parquet(tmp_path / "d.parquet", DOCS[:3]))
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(DataError, match=r"^--tokenizer gpt2 needs the transformers package.*pip install "
                                        r"'p2ptrain\[hf\]'$"):
        load_tokenizer("gpt2")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DataError, match=r"needs the pyarrow package.*pip install 'p2ptrain\[hf\]'"):
        list(iter_documents([parquet], "text"))


def test_importing_tokens_leaves_the_hf_packages_unimported():
    code = ("import sys, p2ptrain.tokens; "
            "print(sorted({'transformers', 'tokenizers', 'pyarrow', 'datasets'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- documents -----------------------------------------------------------------------------------------------------


def test_every_format_gives_the_same_documents_in_order(tmp_path):
    import datasets

    (tmp_path / "hf").mkdir()
    datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))}).save_to_disk(tmp_path / "hf" / "saved")
    sources = {
        "jsonl": write_jsonl(tmp_path / "d.jsonl", DOCS),
        "parquet": write_parquet(tmp_path / "d.parquet", DOCS),
        "arrow file": write_arrow_file(tmp_path / "d.arrow", DOCS),
        "datasets save_to_disk": tmp_path / "hf",  # a folder holding the Arrow stream that datasets writes
    }
    for kind, source in sources.items():
        assert list(iter_documents([str(source)], "text")) == DOCS, kind
    (tmp_path / "d.txt").write_text(DOCS[0] + "\n\n" + DOCS[1])
    assert list(iter_documents([str(tmp_path / "d.txt")], "ignored for .txt")) == [DOCS[0] + "\n\n" + DOCS[1]]
    # another field, blank lines skipped
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "a"}) + "\n\n  \n" + json.dumps({"body": "b"}) + "\n")
    assert list(iter_documents([str(tmp_path / "body.jsonl")], "body")) == ["a", "b"]


def test_folders_are_read_at_any_depth_sorted_by_path(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    write_jsonl(tmp_path / "sub" / "b.jsonl", DOCS[2:4])
    write_parquet(tmp_path / "sub" / "deeper" / "c.parquet", DOCS[4:6])
    (tmp_path / "a.txt").write_text(DOCS[0])
    (tmp_path / "z.txt").write_text(DOCS[1])
    (tmp_path / "sub" / "notes.md").write_text("not data")
    docs = list(iter_documents([str(tmp_path), str(tmp_path / "a.txt")], "text"))
    assert docs == [DOCS[0], DOCS[2], DOCS[3], DOCS[4], DOCS[5], DOCS[1], DOCS[0]]


def test_a_record_without_the_text_field_is_a_one_line_error_at_once(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", DOCS, field="content")
    write_parquet(tmp_path / "d.parquet", DOCS, field="content")
    for name in ("d.jsonl", "d.parquet"):
        with pytest.raises(DataError, match=r"^--data \S+d\.\w+: (line|record) 1 has no field 'text' \(its fields: "
                                            r"(id, content|content, id)\); pass --text-field NAME$"):
            next(iter_documents([str(tmp_path / name)], "text"))


def test_bad_records_are_one_line_errors_naming_them(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "cut off\n')
    with pytest.raises(DataError, match=r"^--data \S+bad\.jsonl: line 2 is not valid JSON .*one JSON object per line$"):
        list(iter_documents([str(bad)], "text"))
    bad.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"line 2 has a int in field 'text', not a string"):
        list(iter_documents([str(bad)], "text"))
    bad.write_text('["not", "an", "object"]\n')
    with pytest.raises(DataError, match=r"line 1 is a JSON list, not an object"):
        list(iter_documents([str(bad)], "text"))
    write_parquet(tmp_path / "nulls.parquet", ["a", None, "c"])
    with pytest.raises(DataError, match=r"nulls\.parquet: record 2 has no value \(null\) in field 'text'"):
        list(iter_documents([str(tmp_path / "nulls.parquet")], "text"))
    with pytest.raises(DataError, match=r"field 'id' holds int64, not text"):
        list(iter_documents([str(tmp_path / "nulls.parquet")], "id"))


def test_unknown_files_and_missing_paths_are_one_line_errors(tmp_path, offline):
    (tmp_path / "d.csv").write_text("text\nhello\n")
    with pytest.raises(DataError, match=r"d\.csv: unknown file type '\.csv'; use \.txt, \.jsonl, \.parquet or \.arrow"):
        iter_documents([str(tmp_path / "d.csv")], "text")
    with pytest.raises(DataError, match=r"no \.txt, \.jsonl, \.parquet or \.arrow files found in this folder"):
        iter_documents([str(tmp_path)], "text")
    with pytest.raises(DataError, match=r"nope\.jsonl: no such file or folder"):
        iter_documents([str(tmp_path / "nope.jsonl")], "text")
    with pytest.raises(DataError, match=r"^--data owner/corpus: not a file or folder here, and the Hugging Face hub "
                                        r"cannot be reached.*; pass local files$"):
        list(iter_documents(["owner/corpus"], "text"))


# --- the token cache -----------------------------------------------------------------------------------------------


def test_the_cache_holds_each_documents_tokens_and_the_separator_between(tmp_path, bpe_folder):
    source = str(write_jsonl(tmp_path / "d.jsonl", DOCS + [""]))  # an empty document leaves no double separator
    for tok, dtype in ((load_tokenizer("bytes"), np.uint8), (load_tokenizer(str(bpe_folder)), np.uint16)):
        tokens = tokenize_to_cache([source], tok, "text", str(tmp_path / "cache"))
        assert tokens.dtype == dtype and tokens.path.parent == tmp_path / "cache"
        assert tokens.read(0, len(tokens)).tolist() == expected_tokens(tok, DOCS)
        meta = json.loads(tokens.path.with_suffix(".json").read_text())
        assert (meta["num_tokens"], meta["documents"], meta["tokenizer"]) == (len(tokens), len(DOCS), tok.name)


def test_bytes_of_txt_files_are_the_bytes_load_corpus_reads(tmp_path):
    for i, doc in enumerate(DOCS[:40]):
        (tmp_path / f"{i:02}.txt").write_text(doc)
    tokens = tokenize_to_cache([str(tmp_path)], load_tokenizer(None), "text", str(tmp_path / "cache"))
    assert bytes(tokens.read(0, len(tokens)).tolist()) == load_corpus([tmp_path])


def test_the_cache_is_reused_until_a_source_changes(tmp_path, caplog):
    source = write_jsonl(tmp_path / "d.jsonl", DOCS)
    cache, tok = str(tmp_path / "cache"), load_tokenizer(None)
    first = tokenize_to_cache([str(source)], tok, "text", cache)
    written = first.path.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="p2ptrain.tokens"):
        again = tokenize_to_cache([str(source)], tok, "text", cache)
    assert again.path == first.path and first.path.stat().st_mtime_ns == written and "reusing" in caplog.text
    assert torch.equal(again.read(0, len(again)), first.read(0, len(first)))
    write_jsonl(source, list(reversed(DOCS)) + ["one more"])
    changed = tokenize_to_cache([str(source)], tok, "text", cache)
    assert changed.path != first.path and len(changed) == len(first) + 2 + len("one more")
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".json"] * 2 + [".tokens"] * 2  # no leftovers


def test_too_little_text_is_a_data_error_and_leaves_no_cache(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", DOCS[:3])
    with pytest.raises(DataError, match=r"only \d+ tokens of text \(bytes\), fewer than the 2048.*point --data at"):
        tokenize_to_cache([str(source)], load_tokenizer(None), "text", str(tmp_path / "cache"))
    assert list((tmp_path / "cache").iterdir()) == []


# --- TokenFile and the batches read from it ------------------------------------------------------------------------


def test_token_file_rows_and_views(tmp_path):
    tokens = [random.Random(0).randrange(65536) for _ in range(5000)]
    file = token_file(tmp_path, tokens)
    assert len(file) == 5000 and file.read(10, 5).tolist() == tokens[10:15]
    rows = file.rows(torch.tensor([0, 7, 4990]), 10)
    assert rows.dtype == torch.int64 and rows.tolist() == [tokens[0:10], tokens[7:17], tokens[4990:5000]]
    view = file.view(1000, 2000)
    assert len(view) == 1000 and view.rows(torch.tensor([5]), 3).tolist() == [tokens[1005:1008]]
    with pytest.raises(IndexError):
        view.rows(torch.tensor([998]), 3)
    train, val = split_train_val(file, 0.1)
    assert (len(train), len(val)) == (4500, 500) and val.read(0, 500).tolist() == tokens[4500:]


def reference_batches(tokens: list[int], batches: ShardedBatches, num_batches: int) -> list[torch.Tensor]:
    """What ``batches`` should yield, from the token list and its visiting order (one shard, no callback)."""
    block, size = batches.block_size, batches.batch_size
    order = torch.cat([batches.window_offsets(e) for e in range(num_batches * size // batches.samples_per_epoch + 1)])
    rows = torch.tensor([tokens[s : s + block + 1] for s in order[: num_batches * size].tolist()])
    return list(rows.split(size))


def test_batches_of_a_token_file_are_its_windows_in_the_shuffled_order(tmp_path):
    tokens = [random.Random(1).randrange(300) for _ in range(6000)]
    batches = ShardedBatches(token_file(tmp_path, tokens), block_size=16, batch_size=5, shard_index=2, num_shards=3)
    for chunk in reference_batches(tokens, batches, 30):  # 30 x 5 samples: past the end of the 124-sample epoch
        x, y = next(batches)
        assert x.dtype == torch.int64 and torch.equal(x, chunk[:, :-1]) and torch.equal(y, chunk[:, 1:])
    assert batches.epoch == 1


def test_a_byte_token_file_gives_exactly_the_batches_of_the_bytes(tmp_path):
    """The same shards, order, shard moves and held-out batches as the in-memory path over the same bytes."""
    data = random.Random(2).randbytes(8000)
    file = token_file(tmp_path, list(data), dtype=np.uint8)

    def moving(source):
        it = ShardedBatches(source, block_size=16, batch_size=7, shard_index=3, num_shards=4, seed=3,
                            on_epoch_end=lambda state: it.state_for((state["shard_index"] + 1) % 4))
        return it

    from_bytes, from_file = moving(split_train_val(data)[0]), moving(split_train_val(file)[0])
    for _ in range(60):  # through several shards
        xb, yb = next(from_bytes)
        xf, yf = next(from_file)
        assert torch.equal(xb, xf) and torch.equal(yb, yf)
    assert from_file.state_dict() == from_bytes.state_dict() and from_file.left_shards == from_bytes.left_shards
    for (xb, yb), (xf, yf) in zip(eval_batches(split_train_val(data)[1], 32, 4, 5),
                                  eval_batches(split_train_val(file)[1], 32, 4, 5), strict=True):
        assert torch.equal(xb, xf) and torch.equal(yb, yf)


@pytest.mark.parametrize("k", [0, 5, 40])
def test_a_token_file_iterator_resumes_exactly_from_its_state_dict(tmp_path, k):
    file = token_file(tmp_path, [random.Random(3).randrange(65536) for _ in range(4000)])

    def make():
        it = ShardedBatches(file, block_size=16, batch_size=4, shard_index=1, num_shards=3,
                            on_epoch_end=lambda state: it.state_for((state["shard_index"] + 1) % 3))
        return it

    old = make()
    for _ in range(k):
        next(old)
    new = make()
    new.load_state_dict(old.state_dict())
    for _ in range(50):  # 83 samples per shard: across shard moves
        assert torch.equal(next(old)[0], next(new)[0])


def test_token_file_errors_count_tokens(tmp_path):
    file = token_file(tmp_path, list(range(1600)))
    with pytest.raises(DataError, match=r"1600 tokens of training text in 16 shards leave 100 tokens per shard"):
        ShardedBatches(file, block_size=128, batch_size=2, shard_index=0, num_shards=16)
    with pytest.raises(DataError, match="held-out text has 20 tokens"):
        eval_batches(file.view(0, 20), block_size=32, batch_size=2, max_batches=8)
