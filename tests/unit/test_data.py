"""Corpus loading, the held-out split, disjoint shards and the resumable batch iterator."""

from __future__ import annotations

import random

import pytest
import torch

from p2ptrain.data import (
    DataError,
    ShardedBatches,
    builtin_corpus_paths,
    eval_batches,
    evaluate,
    load_corpus,
    phase_shortfall,
    split_train_val,
)
from p2ptrain.model import build_model


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def _window(data: bytes, start: int, block_size: int) -> torch.Tensor:
    return torch.tensor(list(data[start : start + block_size]), dtype=torch.long)


# --- load_corpus ---------------------------------------------------------------------------------------------------


def test_load_corpus_joins_files_in_the_given_order(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.md"  # an explicit file needs no .txt suffix
    a.write_bytes(b"A" * 600)
    b.write_bytes(b"B" * 600)
    assert load_corpus([b, a]) == b"B" * 600 + b"\n\n" + b"A" * 600
    assert load_corpus([str(a)], min_bytes=10) == b"A" * 600  # str paths and a lone file work too


def test_load_corpus_reads_nested_txt_files_of_a_folder_sorted(tmp_path):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "z.txt").write_bytes(b"z" * 400)
    (tmp_path / "sub" / "a.txt").write_bytes(b"a" * 400)
    (tmp_path / "sub" / "deeper" / "m.txt").write_bytes(b"m" * 400)
    (tmp_path / "sub" / "notes.md").write_bytes(b"not text for training" * 100)
    (tmp_path / "sub" / "empty.txt").write_bytes(b"")
    data = load_corpus([tmp_path])
    assert data == b"\n\n".join([b"a" * 400, b"m" * 400, b"z" * 400])


def test_missing_path_is_a_data_error_naming_it(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="nope.txt.*no such file"):
        load_corpus([missing])


def test_folder_without_txt_files_is_a_data_error(tmp_path):
    (tmp_path / "readme.md").write_text("hello " * 500)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="no .txt files with text found; point --data at"):
        load_corpus([tmp_path])


def test_too_little_text_is_a_data_error(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("just a line\n")
    with pytest.raises(DataError, match="only 12 bytes.*1024"):
        load_corpus([small])
    assert isinstance(DataError("x"), ValueError)  # the CLI turns every ValueError into a clean exit


def test_builtin_corpus_loads():
    try:
        paths = builtin_corpus_paths()
    except DataError:
        pytest.skip("p2ptrain/corpus has no .txt files yet")
    assert paths == sorted(paths) and all(p.suffix == ".txt" for p in paths)
    data = load_corpus()
    assert len(data) >= 1024
    assert data == load_corpus(None) == load_corpus([])
    train, val = split_train_val(data)
    assert len(val) > 0 and len(train) > len(val)


def test_builtin_corpus_is_the_sorted_txt_files_of_the_corpus_folder(tmp_path, monkeypatch):
    import p2ptrain.data

    monkeypatch.setattr(p2ptrain.data, "CORPUS_DIR", tmp_path)
    with pytest.raises(DataError, match="built-in corpus .* no .txt files"):
        builtin_corpus_paths()
    (tmp_path / "b.txt").write_bytes(b"b" * 700)
    (tmp_path / "a.txt").write_bytes(b"a" * 700)
    (tmp_path / "LICENSE").write_bytes(b"l" * 700)
    assert builtin_corpus_paths() == [tmp_path / "a.txt", tmp_path / "b.txt"]
    assert load_corpus() == b"a" * 700 + b"\n\n" + b"b" * 700


# --- split_train_val -----------------------------------------------------------------------------------------------


def test_split_is_a_deterministic_disjoint_tail_split():
    data = _random_bytes(10_000)
    train, val = split_train_val(data, val_fraction=0.1)
    assert (train, val) == split_train_val(data, val_fraction=0.1)
    assert len(val) == 1000
    assert train + val == data  # disjoint and complete: the held-out bytes are the last 10%


def test_split_rejects_bad_fractions():
    with pytest.raises(ValueError):
        split_train_val(b"x" * 100, val_fraction=0.0)
    with pytest.raises(ValueError):
        split_train_val(b"x" * 100, val_fraction=1.0)


# --- ShardedBatches ------------------------------------------------------------------------------------------------


def test_batches_are_windows_of_the_data_shifted_by_one():
    data = _random_bytes(5000)
    batches = ShardedBatches(data, block_size=16, batch_size=4, shard_index=1, num_shards=3, seed=0)
    x, y = next(batches)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    starts = batches.window_offsets(0)[:4].tolist()
    for row, start in enumerate(starts):
        assert torch.equal(x[row], _window(data, start, 16))
        assert torch.equal(y[row], _window(data, start + 1, 16))


def test_shards_are_disjoint_and_cover_their_ranges():
    data = _random_bytes(10_000)
    block_size, num_shards = 32, 4
    used_bytes = []
    for shard_index in range(num_shards):
        batches = ShardedBatches(data, block_size, batch_size=5, shard_index=shard_index, num_shards=num_shards)
        start, end = batches.shard_range
        # every sample start of one epoch, found from the batches themselves (random bytes: each window is unique)
        rows = torch.cat([next(batches)[0] for _ in range(-(-batches.samples_per_epoch // 5))])
        starts = [data.find(bytes(row.tolist())) for row in rows[: batches.samples_per_epoch]]
        assert len(starts) == len(set(starts)) == batches.samples_per_epoch
        assert sorted(starts) == list(range(start, start + batches.samples_per_epoch * block_size, block_size))
        assert all(start <= s and s + block_size + 1 <= end for s in starts)  # x and y lie inside the shard
        # the windows tile the shard, leaving less than one sample uncovered at its end
        assert end - (start + batches.samples_per_epoch * block_size) < block_size + 1
        used_bytes.append({b for s in starts for b in range(s, s + block_size + 1)})
    for i in range(num_shards):
        for j in range(i + 1, num_shards):
            assert not used_bytes[i] & used_bytes[j]


def test_one_epoch_of_batches_visits_every_window_once():
    data = _random_bytes(3000)
    block_size = 20
    batches = ShardedBatches(data, block_size, batch_size=7, shard_index=0, num_shards=2, seed=3)
    n = batches.samples_per_epoch
    assert n == (1500 - 1) // block_size
    windows = set()
    rows = 0
    while rows < n:
        x, _ = next(batches)
        for row in x[: n - rows]:
            windows.add(bytes(row.tolist()))
        rows += x.shape[0]
    assert len(windows) == n  # random bytes: distinct windows are distinct strings
    expected = {data[s : s + block_size] for s in batches.window_offsets(0).tolist()}
    assert windows == expected


def test_epochs_roll_over_with_a_new_order():
    data = _random_bytes(2000)
    batches = ShardedBatches(data, block_size=10, batch_size=8, shard_index=0, num_shards=1, seed=0)
    n = batches.samples_per_epoch  # 199: batches straddle the epoch boundary
    assert n % 8
    xs = torch.cat([next(batches)[0] for _ in range(2 * n // 8 + 2)])
    assert batches.epoch == 2
    order = torch.cat([batches.window_offsets(0), batches.window_offsets(1), batches.window_offsets(2)])
    for row, start in zip(xs, order.tolist()):
        assert torch.equal(row, _window(data, start, 10))
    assert not torch.equal(batches.window_offsets(0), batches.window_offsets(1))
    assert sorted(batches.window_offsets(0).tolist()) == sorted(batches.window_offsets(1).tolist())


def test_order_depends_on_the_seed_only():
    data = _random_bytes(4000)
    a = ShardedBatches(data, block_size=10, batch_size=4, shard_index=0, num_shards=2, seed=1)
    b = ShardedBatches(data, block_size=10, batch_size=4, shard_index=0, num_shards=2, seed=1)
    c = ShardedBatches(data, block_size=10, batch_size=4, shard_index=0, num_shards=2, seed=2)
    xa, xb, xc = next(a)[0], next(b)[0], next(c)[0]
    assert torch.equal(xa, xb)
    assert not torch.equal(xa, xc)


@pytest.mark.parametrize("k", [0, 3, 12, 25])
def test_resuming_from_state_dict_gives_the_same_next_batches(k):
    data = _random_bytes(3000)
    make = lambda: ShardedBatches(data, block_size=16, batch_size=4, shard_index=1, num_shards=2, seed=5)  # noqa: E731
    old = make()
    for _ in range(k):
        next(old)
    state = old.state_dict()
    new = make()
    new.load_state_dict(state)
    for _ in range(30):  # 46 samples per epoch: this crosses at least one epoch boundary
        x_old, y_old = next(old)
        x_new, y_new = next(new)
        assert torch.equal(x_old, x_new) and torch.equal(y_old, y_new)


def test_state_dict_of_another_shard_moves_the_iterator_there():
    data = _random_bytes(3000)
    a = ShardedBatches(data, block_size=16, batch_size=4, shard_index=0, num_shards=2)
    b = ShardedBatches(data, block_size=16, batch_size=4, shard_index=1, num_shards=2)
    for _ in range(3):
        next(a)
    b.load_state_dict(a.state_dict())
    assert b.shard_index == 0 and b.shard_range == a.shard_range
    assert b.left_shards == {1: {**a.state_for(1), "epoch": 0, "position": 0}}  # where it left shard 1
    for _ in range(20):
        assert torch.equal(next(a)[0], next(b)[0])
    other_layout = ShardedBatches(data, block_size=16, batch_size=4, shard_index=0, num_shards=3)
    with pytest.raises(ValueError, match="num_shards"):
        b.load_state_dict(other_layout.state_dict())
    with pytest.raises(ValueError, match="shard 5"):
        b.load_state_dict({**a.state_dict(), "shard_index": 5})


def _sample_starts(data: bytes, x: torch.Tensor) -> list:
    return [data.find(bytes(row.tolist())) for row in x]


def test_at_the_end_of_a_pass_the_iterator_moves_to_the_shard_it_is_told_mid_batch():
    data = _random_bytes(4000)
    finished = []

    def next_shard(state: dict):
        finished.append(state)
        return batches.state_for(2, epoch=0, position=3) if state["shard_index"] == 0 else None

    batches = ShardedBatches(data, block_size=16, batch_size=5, shard_index=0, num_shards=4, seed=1,
                             on_epoch_end=next_shard)
    n = batches.samples_per_epoch  # 62 samples of shard 0: the 13th batch straddles the end of its pass
    assert n % 5
    rows = torch.cat([next(batches)[0] for _ in range(n // 5 + 1)])
    assert finished == [batches.state_for(0, epoch=1, position=0)]
    assert batches.left_shards == {0: batches.state_for(0, epoch=1, position=0)}
    assert (batches.shard_index, batches.epoch, batches.position) == (2, 0, 3 + 5 - n % 5)
    starts = _sample_starts(data, rows)
    shard0 = ShardedBatches(data, block_size=16, batch_size=5, shard_index=0, num_shards=4, seed=1)
    assert starts[:n] == shard0.window_offsets(0).tolist()  # every sample of shard 0 once, in its order
    shard2 = ShardedBatches(data, block_size=16, batch_size=5, shard_index=2, num_shards=4, seed=1)
    assert starts[n:] == shard2.window_offsets(0)[3 : 3 + 5 - n % 5].tolist()  # then shard 2 from sample 3
    # a shard that stays (the callback says None) starts its next pass, as without a callback
    for _ in range(shard2.samples_per_epoch // 5 + 1):
        next(batches)
    assert batches.shard_index == 2 and batches.epoch == 1 and finished[-1]["shard_index"] == 2


def test_a_moved_iterator_resumes_exactly_from_its_state_dict():
    data = _random_bytes(4000)
    moving = ShardedBatches(data, block_size=16, batch_size=7, shard_index=3, num_shards=4,
                            on_epoch_end=lambda state: moving.state_for((state["shard_index"] + 1) % 4))
    for _ in range(30):  # through several shards
        next(moving)
    assert len(moving.left_shards) >= 2
    fresh = ShardedBatches(data, block_size=16, batch_size=7, shard_index=3, num_shards=4,
                           on_epoch_end=lambda state: fresh.state_for((state["shard_index"] + 1) % 4))
    fresh.load_state_dict(moving.state_dict())
    for _ in range(30):
        assert torch.equal(next(moving)[0], next(fresh)[0])


def test_a_shard_smaller_than_one_inner_phase_is_a_warning_naming_the_numbers():
    assert phase_shortfall(1_000_000, 16, 64, local_steps=50, batch_size=16) is None  # 976 samples >= 800
    # the built-in corpus with every default: the whole of it is less than one phase
    assert phase_shortfall(393_804, 16, 64, local_steps=500, batch_size=16, shard_index=3) == (
        "data shard 3 holds 384 samples (393804 bytes of training text in 16 shards, 64-byte samples), fewer than "
        "one inner phase trains on (local_steps 500 x batch_size 16 = 8000 samples); the whole training text "
        "(6144 samples) is less than one phase: use more data, or fewer samples per phase (--local-steps, "
        "--batch-size)")
    assert phase_shortfall(2_000_000, 16, 64, local_steps=200, batch_size=16) == (
        "data shard 0 holds 1953 samples (2000000 bytes of training text in 16 shards, 64-byte samples), fewer than "
        "one inner phase trains on (local_steps 200 x batch_size 16 = 3200 samples); use fewer shards "
        "(--num-shards 9, the same on every peer), more data, or fewer samples per phase (--local-steps, "
        "--batch-size)")


def test_a_shard_too_small_for_one_sample_is_a_data_error():
    with pytest.raises(DataError, match=r"leave 100 bytes per shard.*fewer shards"):
        ShardedBatches(b"x" * 1600, block_size=128, batch_size=2, shard_index=0, num_shards=16)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shard_index=2, num_shards=2),
        dict(shard_index=-1, num_shards=2),
        dict(shard_index=0, num_shards=0),
        dict(shard_index=0, num_shards=1, block_size=0),
        dict(shard_index=0, num_shards=1, batch_size=0),
    ],
)
def test_bad_arguments_are_value_errors(kwargs):
    args = dict(block_size=8, batch_size=2) | kwargs
    with pytest.raises(ValueError) as info:
        ShardedBatches(b"x" * 1000, **args)
    assert not isinstance(info.value, DataError)


# --- eval_batches / evaluate ---------------------------------------------------------------------------------------


def test_eval_batches_are_deterministic_and_evenly_spaced():
    data = _random_bytes(5000)
    first = eval_batches(data, block_size=32, batch_size=4, max_batches=3)
    second = eval_batches(data, block_size=32, batch_size=4, max_batches=3)
    assert len(first) == 3
    for (xa, ya), (xb, yb) in zip(first, second):
        assert xa.shape == (4, 32) and xa.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    x = torch.cat([xb for xb, _ in first])
    y = torch.cat([yb for _, yb in first])
    assert torch.equal(x[0], _window(data, 0, 32))
    assert torch.equal(x[-1], _window(data, 5000 - 33, 32))  # spread over the whole split, end included
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_eval_batches_of_a_short_split_give_fewer_samples():
    data = _random_bytes(100)
    batches = eval_batches(data, block_size=32, batch_size=2, max_batches=8)
    assert sum(x.shape[0] for x, _ in batches) == 3  # (100 - 1) // 32
    with pytest.raises(DataError, match="held-out text has 20 bytes"):
        eval_batches(data[:20], block_size=32, batch_size=2, max_batches=8)


def test_evaluate_returns_the_mean_loss_and_restores_the_mode():
    model = build_model("tiny")
    batches = eval_batches(_random_bytes(3000), block_size=64, batch_size=4, max_batches=2)
    model.train()
    loss = evaluate(model, batches)
    assert model.training
    model.eval()
    assert evaluate(model, batches) == pytest.approx(loss)
    assert not model.training
    with torch.no_grad():
        expected = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    assert loss == pytest.approx(expected, rel=1e-5)
