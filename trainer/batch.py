"""From leased groups to packed micro-batches: validation, DP sharding, token-budget packing.

Guarantees:
- ``build_batch`` (rows: ``Group`` models or their dicts) and ``build_batch_columns`` (validated
  ``shared.columns.Columns``, what the trainer leases) accept a batch only if every sample can be
  trained on safely; otherwise they raise ``BadBatchError`` naming the group and the problem (token
  outside the vocabulary, samples of one group that disagree in prompt, non-finite or missing
  reward, sequence longer than the model's context, empty prompt, a batch with no groups or no
  trainable token). Both give the same ``TrainBatch`` and the same errors for the same groups:
  the column path checks with numpy, and a group it flags is checked again by the row code,
  which writes the message (so messages never differ). Nothing is mutated.
- A ``TrainBatch`` is columns: flat numpy arrays (tokens, loss masks, logprobs) cut by offsets,
  samples ordered group by group and by ``index`` within a group. It holds no Python object per
  token, so building, broadcasting it to the other ranks (pickle) and packing stay cheap.
- Failed samples (``status == "failed"``, reward null) are kept in the batch for bookkeeping but
  are not packed (loss mask 0 everywhere) and take no part in advantage statistics: they never
  reach the loss. Nor are samples without a trained token (empty response or loss_mask all 0).
- Packing concatenates whole sequences (no padding, a sequence is never split) into micro-batches
  of at most ``token_budget`` tokens; a sequence longer than the budget goes alone into its own
  micro-batch. Every layout is a deterministic function of the batch, so all TP ranks of one DP
  rank build identical micro-batches without talking to each other.

Token layout of one sequence ``t_0 .. t_{L-1}`` with prompt length P: inputs ``t_0 .. t_{L-2}``,
positions ``0 .. L-2``, targets ``t_1 .. t_{L-1}``; target ``j`` is trained when ``j+1 >= P`` and the
sample's ``loss_mask[j+1-P]`` is 1. A sequence thus takes ``L-1`` tokens of the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from headrace.shared.schemas import Group


class BadBatchError(ValueError):
    """A leased batch that cannot be trained on.

    ``problems`` maps each offending group id to what is wrong with it (every bad group of the
    batch, not only the first); ``group_ids`` lists them (empty for a batch with no groups; every
    group of the batch when none has a trainable token). The trainer rejects exactly these groups
    (``POST /v1/leases/{id}/reject``) and trains the others later."""

    def __init__(self, group_ids: str | list[str] | None, problem: str,
                 problems: dict[str, str] | None = None) -> None:
        ids = [group_ids] if isinstance(group_ids, str) else list(group_ids or [])
        self.group_ids = ids
        self.group_id = ids[0] if ids else None
        self.problem = problem
        self.problems = problems if problems is not None else {g: problem for g in ids}
        where = f"group {ids[0]!r}: " if len(ids) == 1 else ""
        super().__init__(f"bad batch: {where}{problem}")


@dataclass(frozen=True)
class SampleRow:
    """One trajectory as the trainer uses it (validated); the arrays are read-only views of the batch."""

    group_id: str
    uid: str
    tokens: np.ndarray                      # int32 [L]
    prompt_len: int
    loss_mask: np.ndarray                   # uint8 [L - prompt_len]
    rollout_logprobs: np.ndarray | None     # float32 [L - prompt_len]; None when unknown or failed
    reward: float | None                    # None: failed
    weight_version: int

    @property
    def failed(self) -> bool:
        return self.reward is None

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def trained_tokens(self) -> int:
        return 0 if self.failed else int(self.loss_mask.sum())


def _cuts(lengths: np.ndarray) -> np.ndarray:
    """Offsets ``[0, l0, l0+l1, ...]`` (int64) of segments of ``lengths``."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _take(flat: np.ndarray, offsets: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The segments ``ids`` of ``flat`` (cut by ``offsets``), in that order: ``(flat', offsets')``."""
    lengths = offsets[1:][ids] - offsets[:-1][ids]
    new = _cuts(lengths)
    idx = np.arange(int(new[-1]), dtype=np.int64) + np.repeat(offsets[:-1][ids] - new[:-1], lengths)
    return flat[idx], new


@dataclass
class TrainBatch:
    """The groups of one training step as columns: samples group by group (``group_sizes`` give
    the layout), by ``index`` within a group. ``[B]`` = per sample, ``[T]`` / ``[R]`` = flat
    tokens / response tokens cut by ``token_offsets`` / ``response_offsets``."""

    group_ids: list[str]
    group_sizes: list[int]
    uids: list[str]                 # [B]
    tokens: np.ndarray              # int32 [T]
    token_offsets: np.ndarray       # int64 [B+1]
    prompt_lens: np.ndarray         # int64 [B]
    loss_mask: np.ndarray           # uint8 [R]
    rollout_logprobs: np.ndarray    # float32 [R], 0 where a sample has none
    has_logprobs: np.ndarray        # bool [B] (False for failed samples)
    reward: np.ndarray              # float64 [B], NaN = failed
    weight_version: np.ndarray      # int64 [B]

    def __post_init__(self) -> None:
        self.response_offsets = _cuts(self.lengths - self.prompt_lens)
        self.failed = np.isnan(self.reward)
        starts, nonempty = self.response_offsets[:-1], np.diff(self.response_offsets) > 0
        self.trained_tokens = np.zeros(len(self.failed), dtype=np.int64)   # sum of loss_mask; 0 when failed
        if nonempty.any():   # a segment of reduceat runs to the next start given: the empty ones add nothing
            self.trained_tokens[nonempty] = np.add.reduceat(self.loss_mask, starts[nonempty], dtype=np.int64)
        self.trained_tokens[self.failed] = 0
        self._samples: list[SampleRow] | None = None

    def __getstate__(self) -> dict[str, Any]:   # broadcast to the other ranks: arrays only
        state = dict(self.__dict__)
        state["_samples"] = None
        return state

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample, int64 [B]."""
        return np.diff(self.token_offsets)

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    @property
    def num_samples(self) -> int:
        return len(self.uids)

    @property
    def samples(self) -> list[SampleRow]:
        """Per-sample views (built once, on first use; no copy of the arrays)."""
        if self._samples is None:
            to, ro = self.token_offsets.tolist(), self.response_offsets.tolist()
            pl, wv, has = self.prompt_lens.tolist(), self.weight_version.tolist(), self.has_logprobs.tolist()
            rewards = [None if math.isnan(r) else r for r in self.reward.tolist()]
            gids = [g for g, n in zip(self.group_ids, self.group_sizes) for _ in range(n)]
            tokens, mask, lp = (_readonly(a) for a in (self.tokens, self.loss_mask, self.rollout_logprobs))
            self._samples = [SampleRow(gids[i], self.uids[i], tokens[to[i]:to[i + 1]], pl[i], mask[ro[i]:ro[i + 1]],
                                       lp[ro[i]:ro[i + 1]] if has[i] else None, rewards[i], wv[i])
                             for i in range(self.num_samples)]
        return self._samples

    def rewards(self) -> tuple[Tensor, Tensor]:
        """``(rewards [B], valid [B])``; failed samples have reward 0 and valid False."""
        r = torch.from_numpy(np.where(self.failed, 0.0, self.reward).astype(np.float32))
        return r, torch.from_numpy(~self.failed)

    def select(self, ids: Sequence[int] | np.ndarray) -> "TrainBatch":
        """The samples ``ids`` (whole groups, in order) as a batch of their own."""
        ids = np.asarray(ids, dtype=np.int64)
        tokens, to = _take(self.tokens, self.token_offsets, ids)
        mask, _ = _take(self.loss_mask, self.response_offsets, ids)
        lp, _ = _take(self.rollout_logprobs, self.response_offsets, ids)
        gids = [g for g, n in zip(self.group_ids, self.group_sizes) for _ in range(n)]
        group_ids: list[str] = []
        sizes: list[int] = []
        for i in ids.tolist():
            if group_ids and group_ids[-1] == gids[i]:
                sizes[-1] += 1
            else:
                group_ids.append(gids[i])
                sizes.append(1)
        return TrainBatch(group_ids, sizes, [self.uids[i] for i in ids.tolist()], tokens, to, self.prompt_lens[ids],
                          mask, lp, self.has_logprobs[ids], self.reward[ids], self.weight_version[ids])

    def subset(self, group_slice: slice) -> "TrainBatch":
        """The groups ``group_slice`` of this batch (mini-batches split by whole groups)."""
        starts = _cuts(np.asarray(self.group_sizes, dtype=np.int64)).tolist()
        gi = range(len(self.group_ids))[group_slice]
        return self.select([i for g in gi for i in range(starts[g], starts[g + 1])])


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


# ---- rows -> batch ------------------------------------------------------------------------------


def _as_group(g: Any) -> Group:
    if isinstance(g, Group):
        return g
    gid = g.get("group_id") if isinstance(g, dict) else None
    try:
        return Group.model_validate(g)
    except Exception as e:  # pydantic ValidationError: keep the field names it reports
        raise BadBatchError(gid, f"invalid group: {e}") from None


@dataclass
class _Row:
    uid: str
    tokens: Sequence[int]
    prompt_len: int
    loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float] | None
    reward: float | None
    weight_version: int


def _group_rows(raw: Any, vocab_size: int, max_seq_len: int | None) -> tuple[str, list[_Row]]:
    """One group's samples (by index); ``BadBatchError`` naming the group if any sample is unusable."""
    g = _as_group(raw)
    gid = g.group_id
    rows: list[_Row] = []
    prompt: Sequence[int] | None = None
    for s in sorted(g.samples, key=lambda s: s.index):
        toks = s.tokens
        failed = s.status == "failed" or s.reward is None
        if failed:  # never fed to the model: only kept for bookkeeping
            rows.append(_Row(s.uid, toks, len(toks) - s.response_length, s.loss_mask, None, None, s.weight_version))
            continue
        bad = [t for t in toks if t < 0 or t >= vocab_size]
        if bad:
            raise BadBatchError(gid, f"sample {s.uid!r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if max_seq_len is not None and len(toks) > max_seq_len:
            raise BadBatchError(gid, f"sample {s.uid!r}: {len(toks)} tokens exceed the model's context of {max_seq_len}")
        p = len(toks) - s.response_length
        if p < 1:
            raise BadBatchError(gid, f"sample {s.uid!r}: empty prompt (response_length {s.response_length} == len(tokens))")
        if prompt is None:
            prompt = toks[:p]
        elif list(toks[:p]) != list(prompt):
            raise BadBatchError(gid, f"sample {s.uid!r}: prompt tokens differ from the group's first sample "
                                     f"(lengths {p} vs {len(prompt)})")
        if not math.isfinite(float(s.reward)):
            raise BadBatchError(gid, f"sample {s.uid!r}: reward {s.reward} is not finite")
        rows.append(_Row(s.uid, toks, p, s.loss_mask, s.rollout_logprobs, float(s.reward), s.weight_version))
    return gid, rows


def _raise_problems(problems: dict[str, str]) -> None:
    if len(problems) == 1:
        raise BadBatchError(list(problems), next(iter(problems.values())), problems)
    raise BadBatchError(list(problems), "; ".join(f"group {g!r}: {p}" for g, p in problems.items()), problems)


def _finish(batch: TrainBatch) -> TrainBatch:
    if len(set(batch.group_ids)) != len(batch.group_ids):
        dup = next(g for g in batch.group_ids if batch.group_ids.count(g) > 1)
        raise BadBatchError(dup, "group appears twice in the batch")
    if not batch.trained_tokens.any():
        raise BadBatchError(batch.group_ids, f"empty batch: no trainable token in groups {batch.group_ids} "
                                             "(all samples failed, empty responses or loss_mask 0)")
    return batch


def build_batch(groups: Sequence[Any], *, vocab_size: int, max_seq_len: int | None = None) -> TrainBatch:
    """Validate leased groups (``Group`` models or their dicts) and lay them out for training; every
    bad group is named in the one ``BadBatchError``."""
    if not groups:
        raise BadBatchError(None, "empty batch: no groups")
    rows: list[_Row] = []
    group_ids: list[str] = []
    sizes: list[int] = []
    problems: dict[str, str] = {}
    for raw in groups:
        try:
            gid, grows = _group_rows(raw, vocab_size, max_seq_len)
        except BadBatchError as e:
            if e.group_id is None:   # no id to name it by: the whole batch is refused
                raise
            problems.setdefault(e.group_id, e.problem)
            continue
        rows.extend(grows)
        group_ids.append(gid)
        sizes.append(len(grows))
    if problems:
        _raise_problems(problems)
    rl = [len(r.tokens) - r.prompt_len for r in rows]
    lp = [x for r, n in zip(rows, rl) for x in (r.rollout_logprobs if r.rollout_logprobs is not None else [0.0] * n)]
    batch = TrainBatch(
        group_ids, sizes, [r.uid for r in rows], np.array([t for r in rows for t in r.tokens], dtype=np.int32),
        _cuts(np.array([len(r.tokens) for r in rows], dtype=np.int64)),
        np.array([r.prompt_len for r in rows], dtype=np.int64),
        np.array([m for r in rows for m in r.loss_mask], dtype=np.uint8), np.array(lp, dtype=np.float64).astype(np.float32),
        np.array([r.rollout_logprobs is not None for r in rows], dtype=bool),
        np.array([math.nan if r.reward is None else r.reward for r in rows], dtype=np.float64),
        np.array([r.weight_version for r in rows], dtype=np.int64))
    return _finish(batch)


# ---- DP sharding and packing -------------------------------------------------------------------


def shard_for_dp(lengths: Sequence[int], dp: int) -> list[list[int]]:
    """Split sample indexes over ``dp`` ranks balancing token counts (longest first to the lightest rank).

    Deterministic; a rank may get no sample when there are fewer samples than ranks.
    """
    loads = [0] * dp
    shards: list[list[int]] = [[] for _ in range(dp)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (loads[r], r))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


@dataclass
class MicroBatch:
    """Whole sequences packed into one flat token stream (see the module docstring for the layout)."""

    sample_ids: list[int]          # indexes into the TrainBatch's samples, in packing order
    input_ids: Tensor              # [N] long
    position_ids: Tensor           # [N] long
    cu_seqlens: Tensor             # [S+1] int32, sequence boundaries in the stream
    target_ids: Tensor             # [N] long
    loss_mask: Tensor              # [N] float 0/1
    seq_index: Tensor              # [N] long, 0..S-1
    rollout_logprobs: Tensor       # [N] float, 0 where unknown
    has_rollout: Tensor            # [N] bool
    extras: dict[str, Tensor] = field(default_factory=dict)  # per-step tensors (old/ref logprobs, advantages)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> "MicroBatch":
        """The same micro-batch with every tensor on ``device`` (a no-op on CPU)."""
        names = ("input_ids", "position_ids", "cu_seqlens", "target_ids", "loss_mask", "seq_index",
                 "rollout_logprobs", "has_rollout")
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in names}
        return MicroBatch(self.sample_ids, **moved, extras={k: v.to(device) for k, v in self.extras.items()})


def _pack_one(batch: TrainBatch, ids: list[int]) -> MicroBatch:
    """One micro-batch of the samples ``ids``, gathered from the batch's arrays with index arithmetic."""
    sel = np.asarray(ids, dtype=np.int64)
    n = np.maximum(batch.lengths[sel] - 1, 0)
    cu = _cuts(n)
    seq = np.repeat(np.arange(len(sel), dtype=np.int64), n)
    pos = np.arange(int(cu[-1]), dtype=np.int64) - cu[:-1][seq]
    src = batch.token_offsets[:-1][sel][seq] + pos
    head = (batch.prompt_lens[sel] - 1)[seq]          # targets before the response
    resp = pos >= head
    ridx = (batch.response_offsets[:-1][sel][seq] + pos - head)[resp]
    mask = np.zeros(len(pos), dtype=np.float32)
    mask[resp] = batch.loss_mask[ridx]
    has = resp & batch.has_logprobs[sel][seq]
    lp = np.zeros(len(pos), dtype=np.float32)
    lp[has] = batch.rollout_logprobs[(batch.response_offsets[:-1][sel][seq] + pos - head)[has]]
    return MicroBatch(
        sample_ids=list(ids),
        input_ids=torch.from_numpy(batch.tokens[src].astype(np.int64)),
        position_ids=torch.from_numpy(pos),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        target_ids=torch.from_numpy(batch.tokens[src + 1].astype(np.int64)),
        loss_mask=torch.from_numpy(mask),
        seq_index=torch.from_numpy(seq),
        rollout_logprobs=torch.from_numpy(lp),
        has_rollout=torch.from_numpy(has),
    )


def pack(batch: TrainBatch, sample_ids: Sequence[int], token_budget: int) -> list[MicroBatch]:
    """Pack ``sample_ids`` into micro-batches of at most ``token_budget`` tokens (first-fit decreasing)."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    lengths = batch.lengths.tolist()
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(sample_ids, key=lambda i: (-lengths[i], i)):
        n = lengths[i] - 1
        for b in range(len(bins)):
            if loads[b] + n <= token_budget:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [_pack_one(batch, sorted(b)) for b in bins]


def micro_batches_for_rank(batch: TrainBatch, dp: int, dp_rank: int, token_budget: int) -> list[MicroBatch]:
    """This DP rank's share of ``batch``, packed."""
    ids = np.flatnonzero(batch.trained_tokens > 0).tolist()
    lengths = batch.lengths.tolist()
    shards = shard_for_dp([lengths[i] - 1 for i in ids], dp)
    return pack(batch, [ids[k] for k in shards[dp_rank]], token_budget)
