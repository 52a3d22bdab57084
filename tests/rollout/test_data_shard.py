"""``rollout.data.shard``: k data sources over the same prompts draw disjoint shares that together
cover every epoch exactly once; each shard's cursor persists in its own file; bad shard configs
are refused with a message naming the key."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from headrace.rollout.data import DataError, DataSource, shard_state_path
from headrace.shared.config import ConfigError, DataConfig, load_config


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i)}) + "\n" for i in range(n)))
    return path


def _cfg(path: Path, index: int, count: int, **kw) -> DataConfig:
    return DataConfig(path=str(path), shard={"index": index, "count": count}, **kw)


def _draw_all(src: DataSource) -> list:
    out = []
    while (item := src.next()) is not None:
        src.mark_done(item)
        out.append(item)
    return out


@pytest.mark.parametrize("n,count", [(10, 2), (10, 3), (7, 7), (5, 1)])
def test_shards_are_disjoint_and_cover_every_epoch_once(tmp_path: Path, n: int, count: int) -> None:
    path = _jsonl(tmp_path / "p.jsonl", n)
    shards = [_draw_all(DataSource(_cfg(path, i, count, epochs=2, seed=3))) for i in range(count)]
    positions = [it.position for s in shards for it in s]
    assert len(positions) == len(set(positions)) == 2 * n            # disjoint, nothing left out
    keys = [it.key for s in shards for it in s]
    assert len(set(keys)) == len(keys)                                # group ids differ across shards
    for epoch in (0, 1):                                              # every item once per epoch
        labels = Counter(it.label for s in shards for it in s if it.epoch == epoch)
        assert labels == Counter(str(i) for i in range(n))
    sizes = [sum(1 for it in s if it.epoch == 0) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    whole = _draw_all(DataSource(DataConfig(path=str(path), epochs=2, seed=3)))   # same shuffle as unsharded
    assert sorted((it.position, it.label) for s in shards for it in s) == [(it.position, it.label) for it in whole]


def test_each_shard_keeps_its_own_cursor_across_restarts(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", 9)
    state = tmp_path / "rollout_state.json"
    a = DataSource(_cfg(path, 0, 2), state)
    b = DataSource(_cfg(path, 1, 2), state)
    assert a.state_path != b.state_path and a.state_path.name == "rollout_state.shard0of2.json"
    first_a = [a.next() for _ in range(3)]
    for it in first_a[:2]:
        a.mark_done(it)                   # the third was drawn but not finished: drawn again after a restart
    got_b = _draw_all(DataSource(_cfg(path, 1, 2, epochs=1), state))
    assert b.next().position == 1 and len(got_b) == 4
    a2 = DataSource(_cfg(path, 0, 2), state)
    assert [a2.next().position for _ in range(3)] == [first_a[2].position, 6, 8]
    assert a2.state()["shard"] == {"index": 0, "count": 2}
    assert not DataSource(_cfg(path, 1, 2, epochs=1), state).next()     # shard 1's epoch is finished


def test_a_cursor_of_another_shard_is_refused(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", 6)
    src = DataSource(_cfg(path, 1, 3), tmp_path / "s.json")
    src.mark_done(src.next())
    shard_state_path(tmp_path / "s.json", _cfg(path, 0, 3).shard).write_text(src.state_path.read_text())
    with pytest.raises(DataError, match=r"cursor is for shard \[1, 3\].*data.shard is \[0, 3\]"):
        DataSource(_cfg(path, 0, 3), tmp_path / "s.json")


def test_bad_shard_configs_name_the_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", 3)
    cases = {"{index: 2, count: 2}": "index 2 is not below count 2",
             "{index: -1, count: 2}": "rollout.data.shard.index",
             "{index: 0, count: 0}": "rollout.data.shard.count",
             "{index: 0, count: 2, size: 4}": "rollout.data.shard.size: unknown key",
             "{index: 0, count: 2, weights: [3, 1, 1]}": "weights has 3 entries but count is 2",
             "{index: 0, count: 2, weights: [3, 0]}": "weights [3, 0]: each must be an integer from 1 to 1000000",
             "{index: 0, count: 2, weights: [3, 1.5]}": "rollout.data.shard.weights.1",
             "{index: 0, count: 2, weights: 3}": "rollout.data.shard.weights",
             "{index: 0, count: 2, split: maybe}": "rollout.data.shard.split",
             "{index: 0, count: 2, split: [false]}": "rollout.data.shard.split"}
    cfg = tmp_path / "run.yaml"
    for value, message in cases.items():
        cfg.write_text(f"rollout:\n  data:\n    path: {path}\n    shard: {value}\n")
        with pytest.raises(ConfigError, match="rollout.data.shard") as e:
            load_config(cfg)
        assert message in str(e.value)
    with pytest.raises(DataError, match="shard 3 of 5 would get no prompt, the data has only 3"):
        DataSource(_cfg(path, 3, 5))


def test_the_fingerprint_says_whether_two_sources_draw_the_same_prompts(tmp_path: Path) -> None:
    """What the trainer compares across services (``/v1/status`` ``data.fingerprint``): equal for
    every shard of the same data, seed and shuffle; different when any of them differs."""
    path = _jsonl(tmp_path / "p.jsonl", 6)
    prints = {DataSource(_cfg(path, i, 3)).state()["fingerprint"] for i in range(3)}
    assert len(prints) == 1 and prints == {DataSource(DataConfig(path=str(path))).state()["fingerprint"]}
    others = [DataSource(_cfg(path, 0, 3, seed=1)), DataSource(_cfg(path, 0, 3, shuffle=False)),
              DataSource(_cfg(_jsonl(tmp_path / "q.jsonl", 6), 0, 3)), DataSource(_cfg(_jsonl(tmp_path / "r.jsonl", 7), 0, 3))]
    assert len({o.state()["fingerprint"] for o in others} | prints) == 5
    weighted = DataSource(DataConfig(path=str(path), shard={"index": 1, "count": 2, "weights": [3, 1]}))
    assert weighted.state()["shard"] == {"index": 1, "count": 2, "weights": [3, 1]}
    assert weighted.state()["fingerprint"] in prints                     # weights do not change the prompts


def test_split_false_draws_every_prompt_of_its_own_data_with_its_own_cursor_and_keys(tmp_path: Path) -> None:
    """``split: false`` (services over different data on one buffer): the prompts and their order are
    the unsharded source's; the cursor file is the shard's and records the split (a split shard's
    file is refused, and the other way round); keys carry ``s<index>of<count>``."""
    path = _jsonl(tmp_path / "p.jsonl", 5)
    state = tmp_path / "rollout_state.json"
    own = DataConfig(path=str(path), epochs=1, seed=4, shard={"index": 1, "count": 2, "split": False})
    got = _draw_all(DataSource(own, state))
    whole = _draw_all(DataSource(DataConfig(path=str(path), epochs=1, seed=4)))
    assert [(it.position, it.label) for it in got] == [(it.position, it.label) for it in whole]
    assert [it.key for it in got] == [f"s1of2-e0-g{g}" for g in range(5)]
    assert whole[0].key == "e0-g0"                                          # unchanged without split: false
    cursor = tmp_path / "rollout_state.shard1of2.json"
    assert json.loads(cursor.read_text())["shard"] == [1, 2] and json.loads(cursor.read_text())["split"] is False
    again = DataSource(own, state)
    assert again.next() is None                                             # the epoch is done: restart kept it
    assert again.state()["shard"] == {"index": 1, "count": 2, "split": False}
    with pytest.raises(DataError, match="cursor is for data.shard.split: false, the config says true"):
        DataSource(_cfg(path, 1, 2), state)
    split = DataSource(_cfg(path, 0, 2), tmp_path / "t.json")
    split.mark_done(split.next())
    with pytest.raises(DataError, match="cursor is for data.shard.split: true, the config says false"):
        DataSource(DataConfig(path=str(path), shard={"index": 0, "count": 2, "split": False}), tmp_path / "t.json")
    # more services than prompts is fine when each draws its own
    assert DataSource(DataConfig(path=str(path), shard={"index": 6, "count": 7, "split": False})).next() is not None
