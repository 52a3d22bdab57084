"""What the TP decoder can run, checked from config.json alone (imports neither torch nor megatron)."""

from __future__ import annotations

from shared.hf_arch import ArchConfig


def check_tp_compatible(arch: ArchConfig, tp: int) -> None:
    """Raise ValueError when ``arch`` cannot be split ``tp`` ways or uses an unsupported activation."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    problems = [f"{name}={val}" for name, val in (("num_attention_heads", arch.num_heads),
                                                  ("num_key_value_heads", arch.num_kv_heads),
                                                  ("intermediate_size", arch.intermediate_size)) if val % tp]
    if problems:
        raise ValueError(f"tensor-parallel size {tp} must divide {', '.join(problems)}")
    act = arch.raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (silu only)")
