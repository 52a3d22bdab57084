"""Prompt sources: jsonl / parquet / reasoning-gym, seeded shuffle, epochs, and the persistent cursor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headrace.rollout.data import DataError, DataSource, load_items
from headrace.shared.config import DataConfig


def _jsonl(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": str(i), "meta": {"i": i}}) + "\n" for i in range(n)))
    return path


def _labels(src: DataSource, k: int) -> list[str]:
    out = []
    for _ in range(k):
        item = src.next()
        assert item is not None
        out.append(item.label)
    return out


def test_jsonl_keys_template_and_metadata(tmp_path: Path) -> None:
    cfg = DataConfig(path=str(_jsonl(tmp_path / "p.jsonl", 3)), shuffle=False, metadata_key="meta",
                     prompt_template="Q: {prompt} A:")
    src = DataSource(cfg)
    item = src.next()
    assert item is not None
    assert (item.prompt, item.label, item.metadata, item.position) == ("Q: q0 A:", "0", {"i": 0}, 0)


def test_parquet_and_chat_messages(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": f"m{i}"}] for i in range(4)]
    pq.write_table(pa.table({"messages": msgs, "answer": ["a", "b", "c", "d"]}), tmp_path / "p.parquet")
    items = load_items(DataConfig(path=str(tmp_path / "p.parquet"), input_key="messages", label_key="answer"))
    assert [i[1] for i in items] == ["a", "b", "c", "d"]
    assert items[2][0] == [{"role": "user", "content": "m2"}]


def test_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        DataSource(DataConfig(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{not json}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        DataSource(DataConfig(path=str(tmp_path / "bad.jsonl")))
    (tmp_path / "nokey.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match="input_key"):
        DataSource(DataConfig(path=str(tmp_path / "nokey.jsonl")))
    with pytest.raises(DataError, match="data.path"):
        DataSource(DataConfig())
    with pytest.raises(DataError, match="no_such_task"):
        DataSource(DataConfig(task="no_such_task", size=4))


def test_seeded_shuffle_epochs_and_exhaustion(tmp_path: Path) -> None:
    path = str(_jsonl(tmp_path / "p.jsonl", 10))
    a = DataSource(DataConfig(path=path, seed=7, epochs=2))
    b = DataSource(DataConfig(path=path, seed=7, epochs=2))
    c = DataSource(DataConfig(path=path, seed=8, epochs=2))
    ea, eb, ec = _labels(a, 20), _labels(b, 20), _labels(c, 20)
    assert ea == eb and ea != ec
    assert sorted(ea[:10]) == sorted(ea[10:]) == sorted(str(i) for i in range(10))  # each epoch a permutation
    assert ea[:10] != ea[10:]  # epochs reshuffle
    assert a.next() is None and a.exhausted()


def test_cursor_survives_restart_without_skip_or_repeat(tmp_path: Path) -> None:
    cfg = DataConfig(path=str(_jsonl(tmp_path / "p.jsonl", 12)), seed=3, epochs=1)
    state = tmp_path / "state.json"
    src = DataSource(cfg, state)
    drawn = [src.next() for _ in range(7)]
    # finished out of order: 0, 1, 2, 4, 6 (3 and 5 still in flight when the process dies)
    for i in (0, 1, 2, 4, 6):
        src.mark_done(drawn[i])
    assert json.loads(state.read_text())["watermark"] == 3
    again = DataSource(cfg, state)
    rest = []
    while (item := again.next()) is not None:
        rest.append(item)
        again.mark_done(item)
    finished = {drawn[i].label for i in (0, 1, 2, 4, 6)}
    redrawn = [it.label for it in rest]
    assert sorted(finished | set(redrawn)) == sorted(str(i) for i in range(12))
    assert not finished & set(redrawn) and len(redrawn) == len(set(redrawn)) == 7
    assert [it.position for it in rest][:2] == [3, 5]  # the in-flight slots come back first, same positions
    assert {it.label for it in rest[:2]} == {drawn[3].label, drawn[5].label}


def test_reasoning_gym_source_and_eval_split() -> None:
    cfg = DataConfig(task="chain_sum", size=20, seed=5, prompt_template="Solve: {prompt}",
                     task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    src = DataSource(cfg)
    item = src.next()
    assert item is not None and item.prompt.startswith("Solve: ")
    assert item.label["task"] == "chain_sum" and "answer" in item.label
    evals = load_items(cfg, eval=True)
    assert len(evals) == cfg.eval_size
    assert {e[0] for e in evals[:20]} != {t[0] for t in src.items}


def test_task_items_are_made_when_read_in_any_order_as_the_eager_list() -> None:
    """A 100,000-prompt pool costs nothing until drawn; entry i is the same whenever it is read."""
    import reasoning_gym

    cfg = DataConfig(task="chain_sum", size=100_000, seed=3, prompt_template="Q: {prompt}",
                     task_config={"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2})
    items = load_items(cfg)
    assert len(items) == 100_000 and len(items._made) == 0   # type: ignore[attr-defined]
    picks = [99_999, 3, 50_000, 0, -1]
    got = [items[i] for i in picks]
    ds = reasoning_gym.create_dataset("chain_sum", seed=3, size=100_000, **cfg.task_config)
    at = [i % 100_000 for i in picks]
    assert [g[0] for g in got] == [f"Q: {ds[i]['question']}" for i in at]
    assert [g[1]["answer"] for g in got] == [ds[i]["answer"] for i in at]
    assert items[2:5] == [items[2], items[3], items[4]] and len(items._made) == 6  # type: ignore[attr-defined]
    with pytest.raises(IndexError):
        items[100_000]
    with pytest.raises(DataError, match="chain_sum"):
        load_items(DataConfig(task="chain_sum", size=10, task_config={"min_terms": 5, "max_terms": 2}))


@pytest.mark.parametrize("shard", [None, {"index": 1, "count": 3}])
def test_peek_shows_the_next_draws_and_changes_nothing(tmp_path: Path, shard: dict | None) -> None:
    """``peek(k)`` (the next round's prompts, tokenized ahead) is what the next ``k`` draws give,
    across an epoch boundary, around finished slots of a restarted cursor and up to exhaustion,
    and leaves the cursor as it was."""
    cfg = DataConfig(path=str(_jsonl(tmp_path / "p.jsonl", 10)), seed=5, epochs=2, shard=shard)
    state = tmp_path / "state.json"
    first = DataSource(cfg, state)
    drawn = [first.next() for _ in range(4)]
    for i in (0, 2, 3):   # slot 1 unfinished: drawn again after the restart, 2 and 3 skipped
        first.mark_done(drawn[i])
    src = DataSource(cfg, state)
    key = lambda it: (it.position, it.epoch, it.prompt, it.label, it.metadata, it.key)   # noqa: E731
    while True:
        before = (src.state(), src._next, set(src._outstanding))
        ahead = src.peek(3)
        assert (src.state(), src._next, set(src._outstanding)) == before
        nxt = [src.next() for _ in range(3)]
        assert [key(it) for it in ahead] == [key(it) for it in nxt if it is not None]
        if any(it is None for it in nxt):
            break
    assert src.peek(5) == [] and src.exhausted()
