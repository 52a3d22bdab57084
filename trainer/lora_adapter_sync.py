"""Weight sync as a LoRA adapter (``trainer.lora_sync: adapter``, DESIGN.md "LoRA").

After each step the policy's adapters (a few MB at rank 16, instead of the whole model) are written
as a PEFT directory ``<run.out>/lora-sync/v<policy_version>`` (``trainer.lora_export.save_peft_adapter``:
gathered over the TP group of data-parallel replica 0, written by its TP rank 0 under a temporary
name and renamed), and the rollout service loads it on every engine as ``v<policy_version>``
(``POST /v1/load_adapter``, ``rollout.adapters``). The loop's ``resume(v)`` then makes generation
name it and unloads the previous one.

Guarantees: the engines' weight version is the policy version (the rollout service sets and checks
it on every engine); a load that fails on any engine is unloaded again everywhere and retried with
backoff for at most ``trainer.sync_timeout_s`` (interruptible by SIGTERM), then raises
``WeightSyncError`` naming the engines: generation keeps the previous adapter meanwhile, never a mix.
Directories of versions older than the previous one are deleted (the engines hold loaded adapters
in memory; a restarted engine gets the current one again from the next sync), except the one before
the previous version, which becomes the next version's directory (renamed, its file overwritten in
place: ``save_peft_adapter(recycle=)``): no engine uses it any more, and reusing its cached pages
makes the write ~10x faster than a new file's.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from typing import Any

from headrace.shared.rollout_client import RolloutError
from headrace.shared.weight_sync.adapter import adapter_dir, adapter_root
from headrace.shared.weight_sync.protocol import WeightSyncError

log = logging.getLogger("headrace.trainer.lora_sync")
_VERSION_DIR = re.compile(r"^v(\d+)(\.tmp|\.old)?$")


def sync_adapter(ctl: Any, st: Any) -> None:
    """Push ``st.model``'s adapters as version ``st.policy_version``; ``ctl`` is the trainer's
    ``EngineControl`` (rank flags, rollout client, config, SIGTERM-aware sleep, phase times). Called
    on every rank: the ranks of replica 0 take part in the TP gather, global rank 0 talks HTTP."""
    from headrace.trainer.lora_export import save_peft_adapter

    if not ctl.gathers:
        return
    t0 = time.perf_counter()
    cfg, version = ctl.cfg, st.policy_version
    # version - 2 was unloaded by resume(version - 1): its directory is rewritten in place as this one
    out = save_peft_adapter(st.model, adapter_dir(cfg, version), base_model_path=cfg.model, lora_cfg=cfg.trainer.lora,
                            durable=False, recycle=adapter_dir(cfg, version - 2) if version >= 2 else None)
    if not ctl.rank0:
        return
    budget, attempt = cfg.trainer.sync_timeout_s, 0
    while True:
        try:
            res = ctl.rollout.load_adapter(str(out), version)
            break
        except RolloutError as e:   # the service's 502 names the engines and what they answered
            attempt += 1
            if time.perf_counter() - t0 > budget or attempt >= 4:
                raise WeightSyncError(f"adapter sync of policy version {version} ({out}) failed: {e}") from None
            log.warning("adapter sync of version %d failed (%s); retry %d", version, e, attempt)
            ctl._sleep(min(10.0, 2.0 * attempt))
    prune(cfg, keep_from=version - 1)
    ctl.times["weight_sync_s"] = ctl.times.get("weight_sync_s", 0.0) + time.perf_counter() - t0
    log.info("adapter v%d loaded on %d engine(s) in %.2fs", version, res.get("engines", 0), time.perf_counter() - t0)


def prune(cfg: Any, keep_from: int) -> None:
    """Delete the adapter directories (and leftovers of interrupted writes) of versions < ``keep_from``."""
    root = adapter_root(cfg)
    if not root.is_dir():
        return
    for d in root.iterdir():
        m = _VERSION_DIR.match(d.name)
        if m and int(m.group(1)) < keep_from and d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
