"""From leased groups to packed micro-batches: validation, DP sharding, token-budget packing.

Guarantees:
- ``build_batch`` accepts a batch only if every sample can be trained on safely; otherwise it raises
  ``BadBatchError`` naming the group and the problem (token outside the vocabulary, samples of one
  group that disagree in prompt, non-finite or missing reward, sequence longer than the model's
  context, empty prompt, a batch with no groups or no trainable token). Nothing is mutated.
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
    """One trajectory as the trainer uses it (validated)."""

    group_id: str
    uid: str
    tokens: tuple[int, ...]
    prompt_len: int
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...] | None
    reward: float | None
    weight_version: int

    @property
    def failed(self) -> bool:
        return self.reward is None

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def trained_tokens(self) -> int:
        return 0 if self.failed else sum(self.loss_mask)


@dataclass
class TrainBatch:
    """The groups of one training step, group by group (``group_sizes`` give the layout)."""

    samples: list[SampleRow]
    group_ids: list[str]
    group_sizes: list[int]

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    def rewards(self) -> tuple[Tensor, Tensor]:
        """``(rewards [B], valid [B])``; failed samples have reward 0 and valid False."""
        r = torch.tensor([0.0 if s.reward is None else s.reward for s in self.samples], dtype=torch.float32)
        v = torch.tensor([not s.failed for s in self.samples], dtype=torch.bool)
        return r, v

    def subset(self, group_slice: slice) -> "TrainBatch":
        """The groups ``group_slice`` of this batch (mini-batches split by whole groups)."""
        starts = [0]
        for n in self.group_sizes:
            starts.append(starts[-1] + n)
        gi = range(len(self.group_ids))[group_slice]
        samples = [s for g in gi for s in self.samples[starts[g]:starts[g + 1]]]
        return TrainBatch(samples, [self.group_ids[g] for g in gi], [self.group_sizes[g] for g in gi])


def _as_group(g: Any) -> Group:
    if isinstance(g, Group):
        return g
    gid = g.get("group_id") if isinstance(g, dict) else None
    try:
        return Group.model_validate(g)
    except Exception as e:  # pydantic ValidationError: keep the field names it reports
        raise BadBatchError(gid, f"invalid group: {e}") from None


def _group_rows(raw: Any, vocab_size: int, max_seq_len: int | None) -> tuple[str, list[SampleRow]]:
    """One group's samples as rows; ``BadBatchError`` naming the group if any sample is unusable."""
    g = _as_group(raw)
    gid = g.group_id
    rows: list[SampleRow] = []
    prompt: tuple[int, ...] | None = None
    for s in sorted(g.samples, key=lambda s: s.index):
        toks = tuple(s.tokens)
        failed = s.status == "failed" or s.reward is None
        if failed:  # never fed to the model: only kept for bookkeeping
            rows.append(SampleRow(gid, s.uid, toks, len(toks) - s.response_length, tuple(s.loss_mask),
                                  None, None, s.weight_version))
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
        elif toks[:p] != prompt:
            raise BadBatchError(gid, f"sample {s.uid!r}: prompt tokens differ from the group's first sample "
                                     f"(lengths {p} vs {len(prompt)})")
        if not math.isfinite(float(s.reward)):
            raise BadBatchError(gid, f"sample {s.uid!r}: reward {s.reward} is not finite")
        rows.append(SampleRow(gid, s.uid, toks, p, tuple(s.loss_mask),
                              None if s.rollout_logprobs is None else tuple(s.rollout_logprobs),
                              float(s.reward), s.weight_version))
    return gid, rows


def build_batch(groups: Sequence[Any], *, vocab_size: int, max_seq_len: int | None = None) -> TrainBatch:
    """Validate leased groups (``Group`` models or their dicts) and lay them out for training; every
    bad group is named in the one ``BadBatchError``."""
    if not groups:
        raise BadBatchError(None, "empty batch: no groups")
    samples: list[SampleRow] = []
    group_ids: list[str] = []
    sizes: list[int] = []
    problems: dict[str, str] = {}
    for raw in groups:
        try:
            gid, rows = _group_rows(raw, vocab_size, max_seq_len)
        except BadBatchError as e:
            if e.group_id is None:   # no id to name it by: the whole batch is refused
                raise
            problems.setdefault(e.group_id, e.problem)
            continue
        samples.extend(rows)
        group_ids.append(gid)
        sizes.append(len(rows))
    if problems:
        if len(problems) == 1:
            raise BadBatchError(list(problems), next(iter(problems.values())), problems)
        raise BadBatchError(list(problems), "; ".join(f"group {g!r}: {p}" for g, p in problems.items()), problems)
    if len(set(group_ids)) != len(group_ids):
        dup = next(g for g in group_ids if group_ids.count(g) > 1)
        raise BadBatchError(dup, "group appears twice in the batch")
    if not any(s.trained_tokens for s in samples):
        raise BadBatchError(group_ids, f"empty batch: no trainable token in groups {group_ids} "
                                       "(all samples failed, empty responses or loss_mask 0)")
    return TrainBatch(samples, group_ids, sizes)


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

    sample_ids: list[int]          # indexes into TrainBatch.samples, in packing order
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
    inp, pos, tgt, msk, sidx, rlp, hr = [], [], [], [], [], [], []
    cu = [0]
    for k, i in enumerate(ids):
        s = batch.samples[i]
        n = len(s.tokens) - 1
        inp.extend(s.tokens[:-1])
        tgt.extend(s.tokens[1:])
        pos.extend(range(n))
        sidx.extend([k] * n)
        head = s.prompt_len - 1      # targets before the response
        m = [0] * head + list(s.loss_mask)
        msk.extend(m)
        if s.rollout_logprobs is not None:
            rlp.extend([0.0] * head + list(s.rollout_logprobs))
            hr.extend([False] * head + [True] * len(s.rollout_logprobs))
        else:
            rlp.extend([0.0] * n)
            hr.extend([False] * n)
        cu.append(cu[-1] + n)
    return MicroBatch(
        sample_ids=list(ids),
        input_ids=torch.tensor(inp, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        target_ids=torch.tensor(tgt, dtype=torch.long),
        loss_mask=torch.tensor(msk, dtype=torch.float32),
        seq_index=torch.tensor(sidx, dtype=torch.long),
        rollout_logprobs=torch.tensor(rlp, dtype=torch.float32),
        has_rollout=torch.tensor(hr, dtype=torch.bool),
    )


def pack(batch: TrainBatch, sample_ids: Sequence[int], token_budget: int) -> list[MicroBatch]:
    """Pack ``sample_ids`` into micro-batches of at most ``token_budget`` tokens (first-fit decreasing)."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(sample_ids, key=lambda i: (-len(batch.samples[i].tokens), i)):
        n = len(batch.samples[i].tokens) - 1
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
    ids = [i for i, s in enumerate(batch.samples) if s.trained_tokens > 0]
    shards = shard_for_dp([len(batch.samples[i].tokens) - 1 for i in ids], dp)
    return pack(batch, [ids[k] for k in shards[dp_rank]], token_budget)
