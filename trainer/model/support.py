"""What the TP decoder can run, checked from config.json alone (imports neither torch nor megatron)."""

from __future__ import annotations

from headrace.shared.hf_arch import ArchConfig


def check_tp_compatible(arch: ArchConfig, tp: int) -> None:
    """Raise ValueError when the decoder cannot run ``arch`` at TP=``tp`` (bad sizes, unsupported activation)."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    if arch.num_heads % arch.num_kv_heads:
        raise ValueError(f"num_attention_heads={arch.num_heads} is not a multiple of num_key_value_heads={arch.num_kv_heads}")
    act = arch.raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (silu only)")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def padded_dims(arch: ArchConfig, tp: int) -> dict[str, int]:
    """Global sizes after padding to a multiple of ``tp``: heads, kv_heads, intermediate, vocab.

    kv heads are padded first and q heads follow (kv_heads * group), so each rank's q heads map
    to its own kv heads; real units always come first, padding sits at the tail.
    """
    group = arch.num_heads // arch.num_kv_heads
    kv = _round_up(arch.num_kv_heads, tp)
    return {"heads": kv * group, "kv_heads": kv, "intermediate": _round_up(arch.intermediate_size, tp),
            "vocab": _round_up(arch.vocab_size, tp)}
