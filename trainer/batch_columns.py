"""Leased columns -> ``TrainBatch`` without per-token Python objects (``trainer.batch`` is the row path).

Guarantees:
- ``build_batch_columns(cols, ...)`` gives exactly the ``TrainBatch`` (and the ``BadBatchError``)
  that ``trainer.batch.build_batch`` gives for the same groups as rows: samples ordered by
  ``index`` within each group, failed samples (status failed or reward null) kept with no reward
  and no logprobs, the same checks. The checks run with numpy over the flat columns; a group they
  flag is rebuilt as rows and checked by the row code, which decides and words the problem, so the
  column path can only be stricter in what it looks at, never different in what it reports.
- The columns are taken as ``shared.columns.decode`` validated them (the row schema's invariants
  hold); when samples are already in index order the batch's arrays are views of them, no copy.
"""

from __future__ import annotations

import numpy as np

from headrace.shared.columns import Columns
from headrace.shared.schemas import SampleStatus
from headrace.trainer.batch import BadBatchError, TrainBatch, _finish, _group_rows, _raise_problems


_FAILED = SampleStatus.failed.value   # an enum's .value is a slow property: read it once


def _owners(offsets: np.ndarray, flags: np.ndarray) -> np.ndarray:
    hits = np.flatnonzero(flags)
    return np.searchsorted(offsets, hits, side="right") - 1 if hits.size else hits


def _flag_samples(b: TrainBatch, group_of: np.ndarray, vocab_size: int, max_seq_len: int | None) -> np.ndarray:
    """Samples (not failed) that may break a rule of ``_group_rows``: bool [B]; may flag more, never less."""
    ok = ~b.failed
    tokens = b.tokens
    bad = np.zeros(len(ok), dtype=bool)
    if tokens.size and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):  # two fast passes in the common case
        bad[_owners(b.token_offsets, (tokens < 0) | (tokens >= vocab_size))] = True
    if max_seq_len is not None:
        bad |= b.lengths > max_seq_len
    bad |= b.prompt_lens < 1
    bad |= ~np.isfinite(b.reward)
    # the prompt of every sample that is not failed equals that of its group's first such sample
    idx = np.flatnonzero(ok)
    if idx.size:
        g = group_of[idx]                   # samples are group by group: a new group starts where g changes
        starts = np.ones(len(idx), dtype=bool)
        starts[1:] = g[1:] != g[:-1]
        ref = idx[starts][np.cumsum(starts) - 1]
        to, pl = b.token_offsets.tolist(), b.prompt_lens.tolist()
        for j, r in zip(idx[~starts].tolist(), ref[~starts].tolist()):   # one memcmp per sample
            p = pl[j]
            if p != pl[r] or tokens[to[j]:to[j] + p].tobytes() != tokens[to[r]:to[r] + p].tobytes():
                bad[j] = True
    return bad & ok


def build_batch_columns(cols: Columns, *, vocab_size: int, max_seq_len: int | None = None) -> TrainBatch:
    """Validated leased columns laid out for training (see the module docstring)."""
    if cols.num_groups == 0:
        raise BadBatchError(None, "empty batch: no groups")
    sizes = np.diff(cols.sample_offsets)
    group_of = np.repeat(np.arange(cols.num_groups, dtype=np.int64), sizes)
    order = np.lexsort((cols.group_index, group_of))
    ordered = bool((order == np.arange(len(order))).all())
    failed = np.isnan(cols.reward) | np.array([s == _FAILED for s in cols.status], dtype=bool)
    has = cols.has_logprobs.astype(bool) & ~failed
    lengths = np.diff(cols.token_offsets)
    b = TrainBatch(list(cols.group_id), sizes.tolist(), list(cols.uid), cols.tokens, cols.token_offsets,
                   lengths - cols.response_length, cols.loss_mask,
                   cols.rollout_logprobs if has.all() else np.where(np.repeat(has, cols.response_length),
                                                                      cols.rollout_logprobs, np.float32(0)),
                   has, np.where(failed, np.nan, cols.reward), cols.weight_version)
    if not ordered:
        b = b.select(order)
        b.group_ids, b.group_sizes = list(cols.group_id), sizes.tolist()   # groups stay whole and in order
    flagged = np.unique(group_of[_flag_samples(b, group_of, vocab_size, max_seq_len)]).tolist()
    if flagged:
        problems: dict[str, str] = {}
        for g, row in zip(flagged, cols.to_rows(flagged)):
            try:
                _group_rows(row, vocab_size, max_seq_len)
            except BadBatchError as e:
                problems.setdefault(e.group_id or row["group_id"], e.problem)
        if problems:
            _raise_problems(problems)
    return _finish(b)
