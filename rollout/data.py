"""Prompt sources (jsonl, parquet, reasoning-gym tasks) with seeded shuffling, epochs and a cursor.

Guarantees:
- Order is a pure function of (seed, epoch): epoch ``e`` visits every item once, in the
  permutation drawn from ``Random(seed * 1_000_003 + e)`` (identity when ``shuffle`` is off).
- Every drawn item has a global position ``g = epoch * len + index_in_epoch``; ``key`` is derived
  from it, so the same prompt slot always gets the same group id (a retried push deduplicates).
- The cursor is the pair (watermark, done-set): every position below the watermark is finished
  (pushed, filtered out or failed), ``done`` lists finished positions above it. The state file is
  rewritten atomically (temp file + rename) on ``mark_done`` (or on ``flush`` when ``autosave`` is
  off), so a restart never skips a prompt: drawn-but-unfinished positions are drawn again. With
  deferred saves a slot finished in the last moments before a crash may be drawn again; its group
  carries the same group id, so the buffer counts it as a duplicate and the trainer never sees it twice.
- Sharding (``data.shard: {index, count}``, several rollout services on one buffer): this source
  owns the positions whose index in their epoch is ``index`` modulo ``count`` and draws only
  those. The shuffle is the same for every shard (same seed), so over all shards each epoch still
  visits every item exactly once, the shards' positions (hence group ids) are disjoint, and each
  shard gets ``len / count`` items per epoch (one more for the lower indexes when it does not
  divide). The watermark counts only owned positions (the others are other shards'); the cursor
  file is per shard (``shard_state_path``) and records its shard: a file of another shard or count
  is refused. With ``split: false`` (services over different data on one buffer) the source draws
  every position of its own data, as unsharded, but keeps the per-shard cursor file (recording the
  split, so a split shard's file is refused) and prefixes its keys with ``s<index>of<count>``: two
  such services never share a cursor or a group id, even under one ``rollout.run_id``.
- ``state()`` carries a ``fingerprint`` of what fixes the prompts' order (source, task options,
  size, seed, shuffle, item count): services with equal fingerprints draw the same prompts in the
  same order, so a trainer driving several can tell whether their shards must be disjoint.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headrace.shared.config import DataConfig
from headrace.shared.config_sections import ShardConfig

EVAL_SEED_OFFSET = 10_000_000  # reasoning-gym seeds shift item indices: keep eval far from training


class DataError(ValueError):
    """A prompt file or task that cannot be used, with the file/line or key in the message."""


@dataclass
class PromptItem:
    """One prompt slot. ``prompt`` is text or a list of chat messages."""

    position: int
    epoch: int
    prompt: str | list[dict[str, Any]]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""   # "s<index>of<count>" for a service with ``data.shard.split: false``: its positions are its own

    @property
    def key(self) -> str:
        return f"{self.source}-e{self.epoch}-g{self.position}" if self.source else f"e{self.epoch}-g{self.position}"


def _read_records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"data.path: file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        records = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
                if not isinstance(rec, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                records.append(rec)
        return records
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DataError(f"data.path: {path} is neither .jsonl nor .parquet")


def _render(cfg: DataConfig, rec: dict[str, Any], where: str) -> tuple[Any, Any, dict[str, Any]]:
    if cfg.input_key not in rec:
        raise DataError(f"{where}: no key {cfg.input_key!r} (data.input_key); keys are {sorted(rec)}")
    prompt = rec[cfg.input_key]
    if isinstance(prompt, str):
        try:
            prompt = cfg.prompt_template.format(prompt=prompt)
        except (KeyError, IndexError, ValueError) as e:
            raise DataError(f"data.prompt_template: cannot format ({e}); use {{prompt}} for the text") from None
    elif not (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)):
        raise DataError(f"{where}: {cfg.input_key!r} must be a string or a list of chat messages")
    label = rec.get(cfg.label_key) if cfg.label_key else None
    meta = rec.get(cfg.metadata_key) if cfg.metadata_key else None
    if meta is not None and not isinstance(meta, dict):
        meta = {cfg.metadata_key: meta}
    return prompt, label, dict(meta or {})


class TaskItems(Sequence):
    """A reasoning-gym task's (prompt, label, metadata) triples, made when first read: entry ``i``
    is a pure function of (seed, i) in reasoning-gym, so the order of reading does not matter and
    a 100,000-prompt pool costs nothing until drawn (made eagerly it took ~5 s of every rollout
    service's start). Entry 0 is made at once, so a task that cannot render fails at startup."""

    def __init__(self, cfg: DataConfig, seed: int, size: int) -> None:
        import reasoning_gym

        self.cfg, self.size = cfg, size
        try:
            self._ds = reasoning_gym.create_dataset(cfg.task, seed=seed, size=size, **cfg.task_config)
            if size:
                self._item(0)
        except Exception as e:  # unknown task or bad option: name it
            raise DataError(f"data.task {cfg.task!r} with task_config {cfg.task_config}: {type(e).__name__}: {e}") from None
        self._made: dict[int, tuple[Any, Any, dict[str, Any]]] = {}

    def __len__(self) -> int:
        return self.size

    def _item(self, i: int) -> tuple[Any, Any, dict[str, Any]]:
        entry = self._ds[i]
        prompt = self.cfg.prompt_template.format(prompt=entry["question"])
        label = {"task": self.cfg.task, "answer": entry["answer"], "metadata": _jsonable(entry.get("metadata", {}))}
        return prompt, label, {}

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.size))]
        i = operator.index(i)
        if i < 0:
            i += self.size
        if not 0 <= i < self.size:
            raise IndexError(f"task item {i} of {self.size}")
        got = self._made.get(i)
        if got is None:
            got = self._made[i] = self._item(i)
        return got


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def shard_state_path(path: str | Path, shard: ShardConfig | None) -> Path:
    """The cursor file of ``shard``: ``path`` itself without sharding (or with count 1), else
    ``<stem>.shard<index>of<count><suffix>``, so services sharing a config never share a cursor."""
    p = Path(path)
    if shard is None or shard.count == 1:
        return p
    return p.with_name(f"{p.stem}.shard{shard.index}of{shard.count}{p.suffix}")


def load_items(cfg: DataConfig, *, eval: bool = False) -> Sequence[tuple[Any, Any, dict[str, Any]]]:
    """(prompt, label, metadata) triples of the training (or evaluation) set, unshuffled (a task's
    are made when first read: ``TaskItems``)."""
    if cfg.task:
        if eval:
            return TaskItems(cfg, cfg.seed + EVAL_SEED_OFFSET, cfg.eval_size)
        return TaskItems(cfg, cfg.seed, cfg.size)
    path = cfg.eval_path if eval else cfg.path
    if not path:
        if eval:
            return []
        raise DataError("data: set either data.path (jsonl / parquet) or data.task (a reasoning-gym task)")
    recs = _read_records(Path(path))
    if not recs:
        raise DataError(f"{path}: no records")
    return [_render(cfg, r, f"{path} record {i}") for i, r in enumerate(recs)]


class DataSource:
    """Draws prompt slots in seeded order and remembers which are finished, across restarts."""

    def __init__(self, cfg: DataConfig, state_path: str | Path | None = None) -> None:
        self.cfg = cfg
        self.items = load_items(cfg)
        shard = cfg.shard if cfg.shard is not None and cfg.shard.count > 1 else None
        self.shard = shard   # the service's place among k (cursor file, group ids, status)
        # the prompts drawn: shard index of count, or all of them (no shard, or ``split: false``)
        self.shard_index, self.shard_count = (shard.index, shard.count) if shard and shard.split else (0, 1)
        self._source = "" if shard is None or shard.split else f"s{shard.index}of{shard.count}"
        if self.shard_index >= len(self.items):
            raise DataError(f"data.shard: shard {self.shard_index} of {self.shard_count} would get no prompt, the "
                            f"data has only {len(self.items)}: use at most {len(self.items)} shards")
        self.state_path = shard_state_path(state_path, shard) if state_path else None
        self._perms: dict[int, list[int]] = {}
        self.watermark = 0
        self.done: set[int] = set()
        if self.state_path and self.state_path.is_file():
            self._load()
        self.watermark = self._owned_from(self.watermark)
        self._next = self.watermark
        self._outstanding: set[int] = set()
        self.autosave = True  # False: the owner calls flush() (the service does, every 0.2 s)
        self._dirty = False
        c = cfg
        order = [c.path and os.path.abspath(c.path), c.task, c.task_config if c.task else None,
                 c.size if c.task else None, c.seed, c.shuffle, c.input_key, len(self.items)]
        self.fingerprint = hashlib.sha256(json.dumps(order, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.items)

    # ---- cursor ----

    def _load(self) -> None:
        assert self.state_path is not None
        try:
            st = json.loads(self.state_path.read_text())
            self.watermark = int(st["watermark"])
            self.done = {int(g) for g in st.get("done", []) if int(g) >= self.watermark}
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{self.state_path}: unreadable data cursor ({e}); delete it to start over") from None
        if st.get("size") not in (None, len(self.items)):
            raise DataError(f"{self.state_path}: cursor is for {st.get('size')} prompts, data has {len(self.items)}; "
                            "delete the file to start over")
        shard, mine = st.get("shard", [0, 1]), [self.shard.index, self.shard.count] if self.shard else [0, 1]
        if shard != mine:
            raise DataError(f"{self.state_path}: cursor is for shard {shard} (index, count), data.shard is "
                            f"{mine}; give each shard its own state_path, or delete the file to start over")
        split = bool(st.get("split", True))
        if split != (self.shard is None or self.shard.split):
            raise DataError(f"{self.state_path}: cursor is for data.shard.split: {json.dumps(split)}, the config "
                            f"says {json.dumps(not split)}: its positions mean other prompts; give it its own "
                            "state_path, or delete the file to start over")

    def _save(self) -> None:
        if not self.state_path:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        st: dict[str, Any] = {"watermark": self.watermark, "done": sorted(self.done), "size": len(self.items),
                              "seed": self.cfg.seed}
        if self.shard is not None:
            st["shard"] = [self.shard.index, self.shard.count]
            if not self.shard.split:
                st["split"] = False
        tmp.write_text(json.dumps(st))
        os.replace(tmp, self.state_path)

    def state(self) -> dict[str, Any]:
        n = len(self.items)
        out = {"epoch": self.watermark // n, "position": self.watermark % n, "watermark": self.watermark,
               "done_ahead": len(self.done), "outstanding": len(self._outstanding),
               "fingerprint": self.fingerprint}
        if self.shard is not None:
            weights = self.shard.weights
            out["shard"] = {"index": self.shard.index, "count": self.shard.count,
                            **({"weights": list(weights)} if weights is not None else {}),
                            **({} if self.shard.split else {"split": False})}
        return out

    # ---- drawing ----

    def _perm(self, epoch: int) -> list[int]:
        p = self._perms.get(epoch)
        if p is None:
            p = list(range(len(self.items)))
            if self.cfg.shuffle:
                random.Random(self.cfg.seed * 1_000_003 + epoch).shuffle(p)
            self._perms = {epoch: p, **{e: q for e, q in self._perms.items() if e >= epoch - 1}}
        return p

    def exhausted(self) -> bool:
        """True once every slot of the configured epochs was drawn (never with epochs: null)."""
        return self._first_from(self._next) is None

    def _owned_from(self, g: int) -> int:
        """The first position >= ``g`` of this shard (``g`` itself without sharding)."""
        k, j, n = self.shard_count, self.shard_index, len(self.items)
        if k == 1:
            return g
        epoch, i = divmod(g, n)
        i += (j - i) % k                   # the next index in the epoch that is j modulo k
        return epoch * n + i if i < n else (epoch + 1) * n + j

    def _skip_done(self, g: int) -> int:
        g = self._owned_from(max(g, self.watermark))  # everything below the watermark is finished
        while g in self.done:
            g = self._owned_from(g + 1)
        return g

    def _first_from(self, g: int) -> int | None:
        """The first unfinished slot of this source at or after ``g``; None past the configured epochs."""
        g = self._skip_done(g)
        return None if self.cfg.epochs is not None and g >= self.cfg.epochs * len(self.items) else g

    def _slot(self, g: int) -> PromptItem:
        epoch, i = divmod(g, len(self.items))
        prompt, label, meta = self.items[self._perm(epoch)[i]]
        return PromptItem(position=g, epoch=epoch, prompt=prompt, label=label, metadata=dict(meta), source=self._source)

    def next(self) -> PromptItem | None:
        """The next unfinished slot, or None when the configured epochs are used up."""
        g = self._first_from(self._next)
        if g is None:
            return None
        self._next = g + 1
        self._outstanding.add(g)
        return self._slot(g)

    def peek(self, k: int) -> list[PromptItem]:
        """The slots the next ``k`` calls of ``next`` would draw, as things stand; nothing changes."""
        out: list[PromptItem] = []
        g = self._next
        while len(out) < k:
            first = self._first_from(g)
            if first is None:
                break
            out.append(self._slot(first))
            g = first + 1
        return out

    def mark_done(self, item: PromptItem) -> None:
        """Record a slot as finished (pushed, filtered or failed) and persist the cursor."""
        g = item.position
        self._outstanding.discard(g)
        if g < self.watermark:
            return
        self.done.add(g)
        while self.watermark in self.done:
            self.done.discard(self.watermark)
            self.watermark = self._owned_from(self.watermark + 1)
        self._dirty = True
        if self.autosave:
            self.flush()

    def flush(self) -> None:
        """Write the cursor if it changed since the last write."""
        if self._dirty:
            self._save()
            self._dirty = False
