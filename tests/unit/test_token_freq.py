"""Loss-token counts written with each shard (store/token_counts.py) and what is built from them: the report's coverage
and the vocabulary maps. Every figure is held to an independent recount from the shards' rows (tests/recount.py),
through slots committed twice, markers without a counts file, a counts file gone, and a sealed run token's late
marker."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import numpy as np
import orjson
import pytest

from tests.recount import as_counter, recount
from tokenmill_runner.export.vocab_maps import ranked_ids, specforge_vocab, speculators_vocab
from tokenmill_runner.report.files import compute_report
from tokenmill_runner.report.markdown import render
from tokenmill_runner.stats.token_freq import REPORT_SIZES, TokenFrequencies
from tokenmill_runner.store.ledger import ShardContent
from tokenmill_runner.store.markers import marker_keys
from tokenmill_runner.store.seals import encode_seal, seal_key
from tokenmill_runner.store.shards import commit_shard, leftovers
from tokenmill_runner.store.storage import LocalStorage
from tokenmill_runner.store.token_counts import dataset_frequencies

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def row(dataset: str, line: int, rng: np.random.Generator, vocab: int = 600, turns: int = 0,
        length: int = 60) -> dict:
    def output() -> list[int]:  # a Zipf head and a flat tail
        n = int(rng.integers(1, length))
        return np.concatenate([rng.zipf(1.3, size=n) % vocab, rng.integers(0, vocab, size=n // 2)]).tolist()

    out = {"sample_id": f"s{line}", "dataset": dataset, "line": line, "sample_index": 0, "prompt_ids": [1, 2, 3],
           "output_ids": output(), "prompt_tokens": 3, "finish_reason": "stop"}
    if turns:  # a conversation: the row's own columns are its last turn's (mode all-turns)
        history: list[int] = [1, 2, 3]
        out["turns"] = []
        for _ in range(turns):
            ids = output()
            out["turns"].append({"prompt_ids": list(history), "output_ids": ids})
            history += ids + [4]
        out["output_ids"], out["prompt_ids"] = out["turns"][-1]["output_ids"], out["turns"][-1]["prompt_ids"]
        out["turn_count"] = turns
    out["completion_tokens"] = len(out["output_ids"])
    return out


def commit(storage, dataset: str, shard_id: str, rows: list[dict], minute: int) -> dict:
    at = T0 + timedelta(minutes=minute)
    return commit_shard(storage, dataset, shard_id, 0, ShardContent(rows, []), clock=lambda: at)


def assert_counts_equal_the_recount(storage, dataset: str) -> TokenFrequencies:
    counted = dataset_frequencies(storage, dataset)
    expected, order = recount(storage, dataset)
    assert as_counter(counted) == expected
    assert counted.seen().tolist() == order, "ids in the order a trainer counting record by record meets them"
    return counted


def test_counts_written_with_each_shard_equal_a_recount_of_its_rows_each_slot_once(tmp_path):
    storage = LocalStorage(tmp_path)
    rng = np.random.default_rng(3)
    commit(storage, "d", "w000-aaaa-000001", [row("d", line, rng) for line in range(1, 30)], 1)
    commit(storage, "d", "w000-aaaa-000002",
           [row("d", line, rng, turns=1 + line % 3) for line in range(30, 45)], 2)  # conversations, turn by turn
    # Another writer committed slots 10-12 again (and a new one): each slot counts once, by its first row, so this
    # shard is recounted from its rows rather than taken from its counts file.
    commit(storage, "d", "w001-bbbb-000001", [row("d", line, rng) for line in (10, 11, 12, 50)], 3)
    # A marker written before counts existed, and one whose counts file is gone: both recounted from their rows.
    old = commit(storage, "d", "w000-aaaa-000003", [row("d", line, rng) for line in range(60, 70)], 4)
    key = next(k for k in marker_keys(storage, "d") if old["shard_id"] in k)
    storage.put(key, orjson.dumps({k: v for k, v in old.items() if k != "token_counts"}))
    gone = commit(storage, "d", "w000-aaaa-000004", [row("d", line, rng) for line in range(70, 80)], 5)
    storage.delete(f"d/{gone['token_counts']}")
    counted = assert_counts_equal_the_recount(storage, "d")
    assert counted.total > 0 and counted.distinct > 100


def test_a_counts_file_without_its_marker_is_a_leftover_and_a_sealed_token_s_late_marker_counts_for_nobody(tmp_path):
    storage = LocalStorage(tmp_path)
    rng = np.random.default_rng(5)
    commit(storage, "d", "w000-aaaa-000001", [row("d", line, rng) for line in range(1, 11)], 1)
    # A taker sealed token aaaa with shard 1; aaaa's next marker landed after the seal: it counts for nobody, and
    # neither does its counts file, whatever it says.
    storage.put_new(seal_key("d", "aaaa"), encode_seal("aaaa", {"commits": ["w000-aaaa-000001"]}, "host:1:bbbb", T0))
    late = commit(storage, "d", "w000-aaaa-000002", [row("d", line, rng) for line in range(11, 21)], 2)
    assert f"d/{late['token_counts']}" in set(leftovers(storage, "d")), "its worker's cleaner removes it"
    counted = assert_counts_equal_the_recount(storage, "d")
    only_first, _ = recount(storage, "d")
    assert counted.total == sum(only_first.values())
    # A shard killed before its marker: data and counts on disk, nothing counted.
    storage.put("d/token_counts/w000-cccc-000001.bin", b"not even a counts file")
    assert "d/token_counts/w000-cccc-000001.bin" in set(leftovers(storage, "d"))
    assert as_counter(dataset_frequencies(storage, "d")) == only_first


def top_k(counts: Counter[int], k: int) -> int:
    return int(np.sort(np.fromiter(counts.values(), dtype=np.int64))[::-1][:k].sum())


def test_the_report_s_coverage_equals_a_recount(tmp_path):
    storage = LocalStorage(tmp_path)
    rng = np.random.default_rng(11)
    # A Zipf tail over 40,000 ids: the report's 8k..64k sizes each cover a different share.
    for n, (dataset, lines) in enumerate((("a", range(1, 301)), ("b", range(1, 201)))):
        rows = [row(dataset, line, rng, vocab=40_000, length=250) for line in lines]
        for start in range(0, len(rows), 128):
            commit(storage, dataset, f"w000-aaaa-{n}{start:05d}", rows[start:start + 128], start)
    storage.put("run.json", orjson.dumps({"name": "cov", "spec": {"datasets": [{"name": "a"}, {"name": "b"}]},
                                          "tokenizer": {}}))
    report = compute_report(storage).report  # what write_report writes, without drawing the PNGs
    section = report["vocabulary"]
    recounted = {name: recount(storage, name)[0] for name in ("a", "b")}
    recounted["mix"] = recounted["a"] + recounted["b"]
    shares = {}
    for name, expected in recounted.items():
        figures = section["mix"] if name == "mix" else section["datasets"][name]
        total = sum(expected.values())
        assert figures["loss_tokens"] == total and figures["distinct_ids"] == len(expected)
        for size in REPORT_SIZES:
            assert figures["covered_tokens"][str(size)] == top_k(expected, size)
            assert figures["coverage"][str(size)] == top_k(expected, size) / total
        for share, needed in figures["ids_for_share"].items():
            assert top_k(expected, needed) >= float(share) * total > top_k(expected, needed - 1)
        shares[name] = [figures["coverage"][str(size)] for size in REPORT_SIZES]
    assert len(set(shares["mix"])) > 2, "the sizes cover different shares: the figures are not all 100 %"
    mix = report["mix"]["shares"]
    assert mix["a"]["loss_tokens"] == sum(recounted["a"].values())
    assert mix["a"]["sample_share"] == 300 / 500
    markdown = render(report, [])
    assert "## Draft vocabulary coverage" in markdown and "| **mix** |" in markdown


def frequencies(units: list[list[int]]) -> TokenFrequencies:
    from tokenmill_runner.stats.token_freq import count_units

    freq = TokenFrequencies()
    offsets = np.cumsum([0, *map(len, units)])
    freq.add(count_units(np.concatenate([np.asarray(u, dtype=np.int64) for u in units]), offsets))
    return freq


def test_each_trainer_breaks_ties_its_own_way_and_fills_up_a_larger_vocabulary_its_own_way():
    # ids 9, 3 and 7 tie at 2; 9 appears first, then 3, then 7.
    freq = frequencies([[9, 5, 5, 5], [3, 9, 7], [7, 3, 1]])
    assert freq.seen().tolist() == [5, 9, 3, 7, 1]
    # speculators: (-count, id) -> 5, then 3 and 7 before 9 (SP vocab_mapping.py:81-83)
    assert speculators_vocab(freq, 3, 20).ids.tolist() == [3, 5, 7]
    assert ranked_ids(freq, 3, 20) == [5, 3, 7]
    # SpecForge: Counter.most_common keeps first appearance among ties -> 5, 9, 3 (SF preprocessing.py:747-750)
    assert specforge_vocab(freq, 3, 20).ids.tolist() == [3, 5, 9]
    # More ids than counted: speculators adds the smallest missing ids, SpecForge the set's first missing ids.
    assert speculators_vocab(freq, 7, 20).ids.tolist() == [0, 1, 2, 3, 5, 7, 9]
    vocab = specforge_vocab(freq, 7, 20)
    assert vocab.ids.size == 7 and {1, 3, 5, 7, 9} <= set(vocab.ids.tolist())
    assert (vocab.d2t + np.arange(7)).tolist() == vocab.ids.tolist() and vocab.t2d.sum() == 7


def test_a_generated_id_outside_the_target_vocabulary_is_refused_by_name():
    from tokenmill_runner.export.vocab_maps import VocabError

    with pytest.raises(VocabError, match="token id 9 .* 8 ids"):
        speculators_vocab(frequencies([[9, 1]]), 2, 8)


def test_weights_scale_a_dataset_s_counts_in_the_mix_and_keep_first_appearance_across_datasets():
    from tokenmill_runner.report.vocabulary import mixed

    a, b = frequencies([[1, 2, 2]]), frequencies([[3, 2]])
    mix = mixed({"a": a, "b": b}, {"b": 3})
    assert as_counter(mix) == Counter({1: 1, 2: 5, 3: 3}) and mix.seen().tolist() == [1, 2, 3]
    half = mixed({"a": a, "b": b}, {"a": 0.5})
    assert half.counts.dtype.kind == "f" and half.counts[2] == pytest.approx(2.0)


def test_the_operator_s_report_reads_no_shard_and_names_the_shards_it_could_not_count(tmp_path):
    from tests.unit.counting_storage import CountingStorage

    storage = CountingStorage(tmp_path)
    rng = np.random.default_rng(13)
    commit(storage, "d", "w000-aaaa-000001", [row("d", line, rng) for line in range(1, 21)], 1)
    commit(storage, "d", "w001-bbbb-000001", [row("d", line, rng) for line in (5, 30)], 2)  # slot 5 twice
    storage.put("run.json", orjson.dumps({"name": "op", "spec": {"datasets": [{"name": "d"}]}, "tokenizer": {}}))
    storage.reset()
    section = compute_report(storage).report["vocabulary"]  # as the operator computes it: recount_rows off
    assert not [key for key in storage.gets if "/shards/" in key], "a tenant's shards are never read"
    assert section["exact"] is False and section["datasets"]["d"]["shards_not_counted"] == 1
    assert "Not counted: d 1 shards" in render(compute_report(storage).report, [])
    exact = compute_report(storage, recount_rows=True).report["vocabulary"]
    assert exact["exact"] and exact["datasets"]["d"]["loss_tokens"] == sum(recount(storage, "d")[0].values())


def test_a_counts_file_that_would_inflate_past_its_cap_is_refused_unread():
    from tokenmill_runner.store.packed import PackError, pack, unpack
    from tokenmill_runner.store.token_counts import COUNTS_BYTES, KIND

    cap = 1 << 20  # decode_counts passes COUNTS_BYTES; a smaller cap keeps the test quick
    assert COUNTS_BYTES >= cap
    bomb = pack(KIND, {"rule": "x"}, {"ids": np.zeros(cap // 4 + 1, dtype="<i4")})
    assert len(bomb) < cap // 100  # a few KB that would inflate past the cap
    with pytest.raises(PackError, match=f"over the {cap}"):
        unpack(KIND, bomb, max_raw=cap)
