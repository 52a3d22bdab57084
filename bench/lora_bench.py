"""LoRA vs full fine-tuning on one model, measured in one run: trainer memory, weight-sync cost,
training throughput. Prints ratios (LoRA / full).

- Optimizer + gradient bytes: the AdamW state tensors (exp_avg, exp_avg_sq) after a real step, plus
  the ``.grad`` tensors a real backward leaves, summed over the trainer's parameters; LoRA rank
  ``--rank`` (alpha 2 x rank, all seven target modules) vs full fine-tuning.
- Weight sync, bytes and seconds per sync into one real reference engine (``headrace engine
  serve``): full (every tensor, ``TPDecoder.hf_state_dict``), merged (what ``EngineControl`` sends
  with ``trainer.lora_sync: merged``: the targeted weights, W + alpha / rank * B A, gather and merge
  included) and adapter (the PEFT directory written by ``trainer.lora_export.save_peft_adapter`` and
  loaded through the engine's ``/load_lora_adapter``, the previous version unloaded). Median of
  ``--repeats``, the three interleaved so machine load hits them alike. The adapter sync is also
  split into its phases (write, load, unload: wall seconds; CPU of the writing thread and of the
  engine process during the load, from /proc schedstat), to tell work from waiting on a busy machine.
  ``--sync-only`` skips the training measurements.
- Training tokens/s: ``trainer.step.train_step`` on the same GRPO batch, LoRA and full alternating
  (median of ``--steps`` after one warm-up step each).

    python bench/lora_bench.py [--preset smollm2-135m] [--rank 16] [--steps 3] [--repeats 3]

TP=1, fp32, one thread per process on CPU. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state(model_dir: str, info, lora: dict | None):
    from headrace.shared.config import TrainerConfig
    from headrace.trainer.lora import apply_lora
    from headrace.trainer.model import load_model
    from headrace.trainer.optim import build_optimizer, build_scheduler
    from headrace.trainer.step import TrainerState

    cfg = TrainerConfig(lr=1e-5, micro_batch_tokens=1 << 20, lora=lora)
    model = load_model(model_dir, info)
    if cfg.lora is not None:
        apply_lora(model, cfg.lora, base_path=model_dir, seed=0)
    opt = build_optimizer(model, cfg)
    return TrainerState(model, opt, build_scheduler(opt, cfg), cfg, info)


def _grad_and_optimizer_bytes(st, batch) -> dict:
    """After a real train step: the optimizer's state bytes; after a real backward: the grad bytes."""
    from headrace.trainer.batch import pack

    (mb,) = pack(batch, range(len(batch.samples)), 1 << 20)
    lp, _ = st.model.token_logprobs(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.target_ids)
    (lp * mb.loss_mask).sum().backward()
    grads = _bytes(p.grad for p in st.model.parameters() if p.grad is not None)
    st.optimizer.zero_grad(set_to_none=True)
    opt = _bytes(v for s in st.optimizer.state.values() for k, v in s.items() if k != "step" and hasattr(v, "numel"))
    trainable = sum(p.numel() for p in st.model.parameters() if p.requires_grad)
    return {"grad_bytes": grads, "optimizer_bytes": opt, "trainable_params": trainable}


def _cpu_of(pid: int) -> float:
    """CPU seconds process ``pid`` has run, all its threads (scheduler statistics, ns resolution)."""
    total = 0
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((t / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):   # a thread that just ended
            pass
    return total / 1e9


def measure(model_dir: str, url: str, adapters_dir: str, rank: int, groups: int, size: int, prompt: int,
            resp: int, steps: int, repeats: int, sync_only: bool = False, engine_pid: int = 0) -> dict:
    import httpx

    from headrace.shared.weight_sync import EngineTarget, WeightSender
    from headrace.trainer.batch import build_batch
    from headrace.trainer.lora_export import save_peft_adapter
    from headrace.trainer.parallel import destroy_distributed, init_distributed
    from headrace.trainer.rollout_control import EngineControl
    from headrace.trainer.step import train_step
    from bench.trainer_bench import make_groups

    info = init_distributed(1, 1)
    try:
        full = _state(model_dir, info, None)
        lora = _state(model_dir, info, {"rank": rank, "alpha": 2 * rank})
        batch = build_batch(make_groups(groups, size, prompt, resp // 2, resp, full.model.arch.vocab_size),
                            vocab_size=full.model.arch.vocab_size)
        out: dict = {}
        times: dict[str, list[float]] = {"full": [], "lora": []}
        tokens = 0
        for s in range(0 if sync_only else steps + 1):            # training throughput, alternating
            for name, st in (("full", full), ("lora", lora)):
                m = train_step(st, batch)
                tokens = int(m["tokens"])
                if s:
                    times[name].append(m["step_time_s"])
        out["tokens_per_step"] = tokens
        for name, st in () if sync_only else (("full", full), ("lora", lora)):
            out[name] = {"step_s": statistics.median(times[name]), "tokens_per_s": tokens / statistics.median(times[name]),
                         **_grad_and_optimizer_bytes(st, batch)}

        sender = WeightSender([EngineTarget(url)], timeout_s=600)
        sender.connect()
        client = httpx.Client(timeout=600)
        sync_t: dict[str, list[float]] = {"full": [], "merged": [], "adapter": []}
        phases: dict[str, list[float]] = {"write": [], "load": [], "unload": []}
        cpu: dict[str, list[float]] = {"write": [], "engine_load": []}
        sync_b: dict[str, int] = {}
        version = 0
        loaded: str | None = None

        def counted(named, key):
            n = 0
            for name, t in named:
                n += t.numel() * t.element_size()
                yield name, t
            sync_b[key] = n

        try:
            sender.update(full.model.hf_state_dict(), weight_version=0)          # warm-up
            for rep in range(repeats + 1):
                version += 1
                t0 = time.perf_counter()
                sender.update(counted(full.model.hf_state_dict(), "full"), weight_version=version)
                t_full = time.perf_counter() - t0
                version += 1
                t0 = time.perf_counter()
                sender.update(counted(EngineControl._named(lora), "merged"), weight_version=version)
                t_merged = time.perf_counter() - t0
                version += 1
                t0, c0 = time.perf_counter(), time.thread_time()
                # as trainer.lora_adapter_sync: the adapter before the previous one (3 versions a repeat) is
                # no longer loaded, and its directory is rewritten in place
                d = save_peft_adapter(lora.model, Path(adapters_dir) / f"v{version}", base_model_path=model_dir,
                                      lora_cfg=lora.cfg.lora, durable=False,
                                      recycle=Path(adapters_dir) / f"v{version - 6}")
                t1, c1, e0 = time.perf_counter(), time.thread_time(), _cpu_of(engine_pid)
                r = client.post(f"{url}/load_lora_adapter", json={"lora_name": f"v{version}", "lora_path": str(d)})
                if r.status_code != 200:
                    raise RuntimeError(f"/load_lora_adapter answered {r.status_code}: {r.text}")
                t2, e1 = time.perf_counter(), _cpu_of(engine_pid)
                if loaded:
                    client.post(f"{url}/unload_lora_adapter", json={"lora_name": loaded}).raise_for_status()
                loaded = f"v{version}"
                t_adapter = time.perf_counter() - t0
                if rep:
                    for k, x in zip(phases, (t1 - t0, t2 - t1, t_adapter - (t2 - t0))):
                        phases[k].append(x)
                    cpu["write"].append(c1 - c0)
                    cpu["engine_load"].append(e1 - e0)
                sync_b["adapter"] = sum(f.stat().st_size for f in d.iterdir())
                if rep:
                    sync_t["full"].append(t_full)
                    sync_t["merged"].append(t_merged)
                    sync_t["adapter"].append(t_adapter)
                print(f"sync repeat {rep}: full {t_full:.2f}s merged {t_merged:.2f}s adapter {t_adapter:.2f}s",
                      flush=True)
        finally:
            sender.shutdown()
            client.close()
        out["sync"] = {k: {"s": statistics.median(v), "bytes": sync_b[k]} for k, v in sync_t.items()}
        out["sync"]["adapter"]["phases_s"] = {k: statistics.median(v) for k, v in phases.items()}
        out["sync"]["adapter"]["cpu_s"] = {k: statistics.median(v) for k, v in cpu.items()}
        return out
    finally:
        destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--resp", type=int, default=64, help="longest response (shortest: half)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "lora")
    ap.add_argument("--sync-only", action="store_true", help="measure the weight syncs only (no training)")
    args = ap.parse_args()

    from headrace.shared.procs import free_port, wait_http
    from headrace.trainer.launch import spawn

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / args.preset
    if not (model_dir / "model.safetensors").exists():
        from headrace.shared.modelzoo import init_model

        print(f"writing {args.preset} to {model_dir} ...", flush=True)
        init_model(args.preset, model_dir)
    adapters = args.out / "adapters"
    adapters.mkdir(exist_ok=True)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(args.out / "engine.log", "ab") as log:
        engine = subprocess.Popen([sys.executable, "-m", "headrace.deploy.cli", "engine", "serve", "--model",
                                   str(model_dir), "--port", str(port), "--threads", "1", "--weight-sync-timeout",
                                   "600", "--allowed-weight-dirs", str(adapters)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 300, lambda: None if engine.poll() is None else f"engine exited {engine.returncode}")
        res = spawn(measure, 1, str(model_dir), url, str(adapters), args.rank, args.groups, args.group_size,
                    args.prompt, args.resp, args.steps, args.repeats, args.sync_only, engine.pid, timeout_s=7200,
                    threads=1)[0]
    finally:
        engine.terminate()
        engine.wait(30)
    s = res["sync"]
    print(f"\n{args.preset}, LoRA rank {args.rank} (all seven targets) vs full fine-tuning, TP=1 fp32, "
          f"{res['tokens_per_step']} tokens per step")
    if not args.sync_only:
        _print_training(res)
    for k in ("merged", "adapter"):
        print(f"sync {k:<8} vs full     bytes {s[k]['bytes']:>12,} / {s['full']['bytes']:,} = "
              f"{s[k]['bytes'] / s['full']['bytes']:.4f}   seconds {s[k]['s']:.3f} / {s['full']['s']:.3f} = "
              f"{s[k]['s'] / s['full']['s']:.3f}")
    print("adapter sync phases (medians): " + ", ".join(f"{k} {v * 1000:.1f} ms"
                                                         for k, v in s["adapter"]["phases_s"].items())
          + "; CPU: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in s["adapter"]["cpu_s"].items()))
    print(json.dumps({"preset": args.preset, "rank": args.rank, **res}))


def _print_training(res: dict) -> None:
    f, lo = res["full"], res["lora"]
    mem_f = f["grad_bytes"] + f["optimizer_bytes"]
    mem_l = lo["grad_bytes"] + lo["optimizer_bytes"]
    print(f"trainable parameters      full {f['trainable_params']:>12,}  lora {lo['trainable_params']:>12,}  "
          f"ratio {lo['trainable_params'] / f['trainable_params']:.4f}")
    print(f"optimizer + grad bytes    full {mem_f:>12,}  lora {mem_l:>12,}  ratio {mem_l / mem_f:.4f}")
    print(f"training tokens/s         full {f['tokens_per_s']:>12.1f}  lora {lo['tokens_per_s']:>12.1f}  "
          f"ratio {lo['tokens_per_s'] / f['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
