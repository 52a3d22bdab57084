"""The trainer's tensor-parallel decoder for the Qwen2 / Qwen3 / Llama families.

Built from megatron-core's tensor-parallel layers (``VocabParallelEmbedding``,
``ColumnParallelLinear``, ``RowParallelLinear``) with an explicit TP group, so one code path runs
gloo on CPU and NCCL on GPU. megatron's weight initialisation (which needs its CUDA RNG tracker) is
skipped: every parameter is filled from a Hugging Face checkpoint by ``trainer.model.loading``.
Numerics (RMSNorm, rotary embeddings) come from ``shared.hf_arch``, the same functions the
inference engine uses.

Layout per layer, per TP rank (Megatron's): q/k/v projections fused into one column-parallel
linear whose local output is [q heads of this rank | k heads | v heads]; gate/up fused likewise as
[gate slice | up slice]; o_proj and down_proj row-parallel (one all-reduce each in forward).

Sizes that TP does not divide are padded at the tail with zero weights (``support.padded_dims``):
kv heads (q heads follow, keeping the GQA grouping), the MLP width and the vocabulary. So
SmolLM2-135M (9 heads, 3 kv heads) runs at TP=2 as 12/4 heads. A zero-padded head or MLP unit
outputs exactly 0 and receives exactly 0 gradient, so padding stays zero under training and is
dropped on export; ``forward`` returns this rank's logits without the padding columns.

Inputs are one packed token stream: ``input_ids`` [T], ``position_ids`` [T] and ``cu_seqlens``
[S+1] (sequence boundaries, cu_seqlens[0] == 0, cu_seqlens[-1] == T). Attention is causal inside
each sequence and never crosses a boundary (``trainer.model.attention``).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from headrace.shared.hf_arch import ArchConfig, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq
from headrace.trainer.model.attention import AttentionPlan, packed_causal_attention
from headrace.trainer.model.attention import plan as plan_attention
from headrace.trainer.model.loading import gather_hf_tensors
from headrace.trainer.model.logprobs import vocab_parallel_logprobs
from headrace.trainer.model.support import check_tp_compatible, padded_dims
from headrace.trainer.parallel import ParallelInfo

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

if not torch.cuda.is_available():  # advice about a CUDA stream setting, meaningless on CPU
    warnings.filterwarnings("ignore", message="When using async grad allreduce", category=UserWarning)


def _no_init(_: torch.Tensor) -> None:
    """Weights come from the checkpoint; megatron's initialisers are never called."""


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's "copy to TP region")."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class RMSNorm(torch.nn.Module):
    """HF RMSNorm (replicated on every TP rank).

    ``partial_group``: set when this rank normalises only part of the inputs the weight sees (Qwen3's
    per-head q/k norm, heads split over TP): the weight's gradient is then summed over that group,
    so every rank holds the full, identical gradient of the replicated weight.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, partial_group: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.partial_group = partial_group if partial_group is not None and partial_group.size() > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.partial_group is None else _SumGradOverGroup.apply(self.weight, self.partial_group)
        return rms_norm(x, w, self.eps)


class Attention(torch.nn.Module):
    """GQA self-attention with RoPE, optional qkv bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, arch: ArchConfig, cfg: ModelParallelConfig, group: Any) -> None:
        super().__init__()
        tp = group.size()
        dims = padded_dims(arch, tp)
        self.head_dim = hd = arch.head_dim
        self.n_heads, self.n_kv = dims["heads"] // tp, dims["kv_heads"] // tp
        self.qkv = ColumnParallelLinear(arch.hidden_size, (dims["heads"] + 2 * dims["kv_heads"]) * hd, config=cfg,
                                        init_method=_no_init, bias=arch.qkv_bias, gather_output=False, tp_group=group)
        self.o = RowParallelLinear(dims["heads"] * hd, arch.hidden_size, config=cfg,
                                   init_method=_no_init, bias=arch.o_bias, input_is_parallel=True,
                                   skip_bias_add=False, tp_group=group)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, cfg.params_dtype, partial_group=group)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, cfg.params_dtype, partial_group=group)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        T, hd = x.shape[0], self.head_dim
        qkv, _ = self.qkv(x)
        q, k, v = qkv.split([self.n_heads * hd, self.n_kv * hd, self.n_kv * hd], dim=-1)
        q, k, v = q.view(T, self.n_heads, hd), k.view(T, self.n_kv, hd), v.view(T, self.n_kv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_heads != self.n_kv:   # GQA: repeat kv heads (SDPA's fused CPU kernel needs equal heads)
            group = self.n_heads // self.n_kv
            k = k.unsqueeze(2).expand(T, self.n_kv, group, hd).reshape(T, self.n_heads, hd)
            v = v.unsqueeze(2).expand(T, self.n_kv, group, hd).reshape(T, self.n_heads, hd)
        attn = packed_causal_attention(q, k, v, plan)
        out, _ = self.o(attn)
        return out


class MLP(torch.nn.Module):
    """SwiGLU MLP: column-parallel [gate | up], row-parallel down."""

    def __init__(self, arch: ArchConfig, cfg: ModelParallelConfig, group: Any) -> None:
        super().__init__()
        inter = padded_dims(arch, group.size())["intermediate"]
        self.local = inter // group.size()
        self.gate_up = ColumnParallelLinear(arch.hidden_size, 2 * inter, config=cfg, init_method=_no_init,
                                            bias=arch.mlp_bias, gather_output=False, tp_group=group)
        self.down = RowParallelLinear(inter, arch.hidden_size, config=cfg, init_method=_no_init,
                                      bias=arch.mlp_bias, input_is_parallel=True, skip_bias_add=False,
                                      tp_group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu, _ = self.gate_up(x)
        gate, up = gu.split(self.local, dim=-1)
        out, _ = self.down(F.silu(gate) * up)
        return out


class DecoderLayer(torch.nn.Module):
    def __init__(self, arch: ArchConfig, cfg: ModelParallelConfig, group: Any) -> None:
        super().__init__()
        self.input_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, cfg.params_dtype)
        self.attn = Attention(arch, cfg, group)
        self.post_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, cfg.params_dtype)
        self.mlp = MLP(arch, cfg, group)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin, plan)
        return x + self.mlp(self.post_norm(x))


class TPDecoder(torch.nn.Module):
    """Tensor-parallel causal LM; each TP rank holds its shard. Build with ``load_model``."""

    def __init__(self, arch: ArchConfig, info: ParallelInfo, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        check_tp_compatible(arch, info.tp)
        self.arch, self.info, self.dtype = arch, info, dtype
        group = info.tp_group
        if group.size() != info.tp:
            raise ValueError(f"tp group has {group.size()} ranks but info.tp={info.tp}")
        cfg = ModelParallelConfig(tensor_model_parallel_size=info.tp, use_cpu_initialization=True,
                                  perform_initialization=False, params_dtype=dtype)
        tp = info.tp
        self.padded_vocab = padded_dims(arch, tp)["vocab"]
        self.vocab_local = self.padded_vocab // tp
        self.vocab_start = info.tp_rank * self.vocab_local
        # columns of the local logits that are real tokens (the tail of the last shard is padding)
        self.vocab_valid = max(0, min(arch.vocab_size - self.vocab_start, self.vocab_local))
        self.embed = VocabParallelEmbedding(self.padded_vocab, arch.hidden_size, init_method=_no_init,
                                            config=cfg, tp_group=group)
        self.layers = torch.nn.ModuleList(DecoderLayer(arch, cfg, group) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        # tied: megatron's way, a column-parallel head without its own weight, fed the embedding's
        self.tied = arch.tie_word_embeddings
        self.lm_head = ColumnParallelLinear(arch.hidden_size, self.padded_vocab, config=cfg, init_method=_no_init,
                                            bias=False, gather_output=False, tp_group=group,
                                            skip_weight_param_allocation=self.tied)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    # ------------------------------------------------------------------ forward
    def _check_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> list[int]:
        if input_ids.dim() != 1 or position_ids.shape != input_ids.shape:
            raise ValueError(f"input_ids and position_ids must both be [T]; got {tuple(input_ids.shape)} "
                             f"and {tuple(position_ids.shape)}")
        T = input_ids.shape[0]
        bounds = [int(b) for b in cu_seqlens.tolist()]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise strictly from 0 to T={T}; got {bounds[:8]}{'...' if len(bounds) > 8 else ''}")
        if T:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.arch.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.arch.vocab_size})")
        return bounds

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Local logits shard [T, V_local] (this rank's vocabulary slice, padding columns dropped)."""
        attn_plan = plan_attention(self._check_inputs(input_ids, position_ids, cu_seqlens), input_ids.device)
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn_plan)
        x = self.norm(x)
        logits, _ = self.lm_head(x, weight=self.embed.weight if self.tied else None)
        return logits[:, : self.vocab_valid] if self.vocab_valid < self.vocab_local else logits

    def token_logprobs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                       target_ids: torch.Tensor, *, temperature: float = 1.0,
                       with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p(target_ids[i] | tokens up to i) [T] and optionally the entropy [T]; differentiable.

        A collective over the TP group. ``target_ids`` are global token ids (usually the input shifted
        by one inside each sequence; the value at a sequence's last position is the caller's choice
        and its logprob should be masked).
        """
        if target_ids.shape != input_ids.shape:
            raise ValueError(f"target_ids {tuple(target_ids.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        if target_ids.numel():
            lo, hi = int(target_ids.min()), int(target_ids.max())
            if lo < 0 or hi >= self.arch.vocab_size:
                raise ValueError(f"target id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.arch.vocab_size})")
        logits = self.forward(input_ids, position_ids, cu_seqlens)
        return vocab_parallel_logprobs(logits, target_ids, vocab_start=self.vocab_start, group=self.info.tp_group,
                                       temperature=temperature, with_entropy=with_entropy)

    # ------------------------------------------------------------------ export
    def hf_state_dict(self, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors with HF names (model device and dtype, padding removed), gathered over TP;
        yields on TP rank 0 only. A collective: every TP rank must exhaust the iterator.
        ``copy=False``: see ``gather_hf_tensors`` (views of live parameters where nothing is gathered)."""
        yield from gather_hf_tensors(self, copy=copy)
