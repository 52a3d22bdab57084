"""Weight sync, trainer side: push full Hugging Face-named tensors from trainer rank 0 to every
engine over one torch.distributed process group, through SGLang's weight-update HTTP API.

The group is {trainer rank 0} + every engine rank. Engine ``i`` (``world_size`` ranks, its TP
size) joins at ``rank_offset = 1 + sum(world_size of engines before it)``, through
``/init_weights_update_group`` while this process joins as rank 0 (``group.join_update_group``).

``WeightSender.update`` guarantees:
- the update runs inside ``/begin_weight_update`` ... ``/end_weight_update`` on every engine;
- tensors go in buckets of one dtype and at most ``bucket_bytes`` each (a tensor larger than
  that gets a bucket of its own), in their given order within a dtype; one
  ``/update_weights_from_distributed`` request per bucket, naming the bucket's own load format.
  ``"flattened_bucket"``: a bucket is broadcast as one flat tensor, the concatenation of the
  flattened tensors in ``names`` order, exactly what SGLang's receiver allocates; ``None``: each
  tensor is broadcast in ``names`` order, SGLang's default mode. ``"auto"`` (the default) sends a
  bucket whose tensors already lie back to back in one storage (the trainer's parameters at TP 1,
  ``buckets.contiguous_run``) flat straight from that storage, with no copy; any other bucket flat
  through a pack copy on NCCL, per tensor on gloo (on CPU the pack copy costs more than it saves,
  see bench/weight_sync_bench.py);
- for each bucket the metadata is posted to every engine concurrently while rank 0 broadcasts
  (``fanout``), so neither side waits on the other; packing the next bucket overlaps the current
  broadcast;
- only the last bucket carries ``weight_version``, so an engine reports the new version only if
  every bucket loaded; after ``/end_weight_update`` every engine must report that version on
  ``/get_model_info`` (``/model_info``, ``/get_server_info`` as fallbacks), else WeightSyncError;
- every step (connect, begin, each bucket, end, verify, close) is bounded by ``timeout_s``; an
  engine that answers an error, drops the connection or does not answer in time raises
  ``WeightSyncError`` naming its URL. After a failed update the engines may hold partially
  updated weights under the old version, so they are left inside their update session (where
  neither SGLang nor the reference engine generates) and rank 0's group is torn down: do not
  resume the rollout; ``reconnect()`` and push the whole update again (its first step ends the
  stale sessions), or stop the run. Never a silent mix of versions.

Backend "gloo" runs on CPU (tested here); "nccl" moves buckets to the current CUDA device (the same
code path; needs GPUs, not tested on this machine).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from headrace.shared.procs import free_port
from headrace.shared.weight_sync.buckets import contiguous_run, dtype_name, flatten_bucket, plan_buckets
from headrace.shared.weight_sync.fanout import Fanout, spawn
from headrace.shared.weight_sync.group import destroy_update_group, join_update_group
from headrace.shared.weight_sync.protocol import (FLATTENED, DestroyGroupRequest, EngineTarget, InitGroupRequest,
                                                  UpdateBucketRequest, WeightSyncError, wire)

__all__ = ["WeightSender"]

log = logging.getLogger("headrace.weight_sync")
Bucket = list[tuple[str, torch.Tensor]]


def _destroy_last_refs(refs: list[Any]) -> None:
    """Destroy a group and drop the last references to it and its in-flight work, so its sockets
    close (peers still waiting in a receive then fail) in this thread, not the caller's."""
    pg, works = refs
    refs.clear()
    works.clear()  # a traceback's frame may still hold the list; it must not hold the works
    destroy_update_group(pg)


class WeightSender:
    """Trainer rank 0's end of weight sync: ``connect()`` once, ``update()`` per policy version,
    ``close()`` at the end (or use it as a context manager). Not thread-safe: one caller."""

    def __init__(self, engines: Sequence[EngineTarget], *, backend: str = "gloo",
                 group_name: str = "headrace_weights", master_address: str = "127.0.0.1",
                 master_port: int | None = None, bucket_bytes: int = 256 << 20,
                 timeout_s: float = 300.0, token: str | None = None,
                 load_format: str | None = "auto") -> None:
        self.engines = [e if isinstance(e, EngineTarget) else EngineTarget(**e) for e in engines]
        if not self.engines:
            raise ValueError("WeightSender needs at least one engine")
        urls = [e.url for e in self.engines]
        if len(set(urls)) != len(urls):
            raise ValueError(f"engine urls must be distinct: {urls}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not group_name:
            raise ValueError("group_name must not be empty")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if load_format not in ("auto", FLATTENED, None):
            raise ValueError(f"load_format must be 'auto', {FLATTENED!r} or None (one broadcast per tensor), "
                             f"got {load_format!r}")
        self.load_format = load_format   # "auto": chosen per bucket (``_pack``)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.backend, self.base_group_name = backend, group_name
        self.master_address, self.master_port = master_address, master_port
        self.bucket_bytes, self.timeout_s = int(bucket_bytes), float(timeout_s)
        self.rank_offsets: list[int] = []
        offset = 1
        for e in self.engines:
            self.rank_offsets.append(offset)
            offset += e.world_size
        self.world_size = offset
        self._fanout = Fanout(self.engines, self.timeout_s, token)
        self._pg: dist.ProcessGroup | None = None
        self._inflight: list[Any] = []  # the broadcasts of the current bucket (torch Work objects)
        self._pack_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # freed after each update
        self._zero_copy = 0   # buckets of the current update sent straight from their tensors' storage
        self._joined = False  # the engines are in group ``group_name``
        self._sessions_may_be_open = True  # a crashed predecessor or a failed update may have left one
        self._generation = 0
        self._broken: str | None = None
        self.group_name = group_name
        self.last_stats: dict[str, float] = {}

    # -- lifecycle --

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def connect(self) -> None:
        """Create the group: every engine joins through ``/init_weights_update_group`` (posted
        concurrently) while this process joins as rank 0. Raises WeightSyncError naming the engine
        that failed or did not join within ``timeout_s``."""
        if self._joined:
            return
        self.group_name = self._unused_group_name()
        # A trainer that crashed (or a sender abandoned after a failure) leaves its group on the
        # engines, and an engine refuses to join a second one: destroy it first (engines without
        # one answer 400, which is fine; a dead engine fails the init).
        self._fanout.best_effort("/destroy_weights_update_group", wire(DestroyGroupRequest(group_name=self.group_name)))
        local = "127.0.0.1" if self.master_address in ("127.0.0.1", "localhost") else ""
        port = self.master_port or free_port(local)
        bodies = [wire(InitGroupRequest(master_address=self.master_address, master_port=port, rank_offset=off,
                                        world_size=self.world_size, group_name=self.group_name,
                                        backend=self.backend)) for off in self.rank_offsets]
        futures = self._fanout.each("/init_weights_update_group", bodies)
        join = spawn(join_update_group, self.master_address, port, 0, self.world_size, self.group_name,
                     self.backend, self.timeout_s)
        try:
            self._fanout.wait(futures, f"init group {self.group_name!r}", local=join)
        except WeightSyncError:
            if join.done() and join.exception() is None:
                spawn(destroy_update_group, join.result())
            raise
        self._pg = join.result()
        self._joined = True
        self._broken = None
        log.info("weight-sync group %s: %d ranks, %d engines, port %d", self.group_name, self.world_size,
                 len(self.engines), port)

    def _unused_group_name(self) -> str:
        """The base name, or the first ``<base>_r<n>`` this process has no group of (a group left by
        a failed update may still be registered until its last collective times out)."""
        from torch.distributed.distributed_c10d import _world
        taken = set(_world.pg_names.values())
        n = self._generation
        name = self.base_group_name if n == 0 else f"{self.base_group_name}_r{n}"
        while name in taken:
            n += 1
            name = f"{self.base_group_name}_r{n}"
        return name

    def close(self) -> None:
        """Destroy the group locally, then on every engine (``/destroy_weights_update_group``).
        Raises WeightSyncError naming engines that failed to answer (the local group is gone anyway)."""
        if not self._joined:
            return
        self._drop_local_group()
        self._joined = False
        self._generation += 1
        futures = self._fanout.each("/destroy_weights_update_group",
                                    wire(DestroyGroupRequest(group_name=self.group_name)), min(self.timeout_s, 30.0))
        failed = []
        for url, fut in futures.items():
            try:
                fut.result(timeout=self.timeout_s + 1)
            except Exception as exc:  # noqa: BLE001 - collected into one error
                failed.append((url, exc))
        if failed:
            raise WeightSyncError("destroy group: " + "; ".join(f"{u}: {e}" for u, e in failed),
                                  [u for u, _ in failed])

    def _drop_local_group(self) -> None:
        """Destroy rank 0's group. Closing its connections also ends any receive an engine still
        waits in. After a failure its last collective may still wait for a dead or hung peer, so
        then it is destroyed in the background (bounded by the group timeout)."""
        pg, self._pg = self._pg, None
        inflight, self._inflight = self._inflight, []
        if pg is None:
            return
        done = spawn(_destroy_last_refs, [pg, inflight])
        del pg, inflight
        if not self._broken:
            done.result()
        else:
            wait_futures([done], timeout=2.0)

    def reconnect(self) -> None:
        """close() ignoring engine errors, then connect() with a fresh group name."""
        try:
            self.close()
        except WeightSyncError as exc:
            log.warning("weight-sync reconnect: %s", exc)
        self.connect()

    def shutdown(self) -> None:
        """close() and release the HTTP client."""
        try:
            self.close()
        finally:
            self._fanout.close()

    def __enter__(self) -> "WeightSender":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- update --

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> None:
        """Push full HF-named tensors to every engine as ``weight_version`` (see module docstring).
        ``named_tensors`` may be a generator (e.g. TP-gathering layer by layer); it is consumed
        bucket by bucket. Returns once every engine reports the version; WeightSyncError otherwise."""
        if isinstance(weight_version, bool) or not isinstance(weight_version, int) or weight_version < 0:
            raise ValueError(f"weight_version must be an int >= 0, got {weight_version!r}")
        if self._broken:
            raise WeightSyncError(f"the weight-sync group is broken by an earlier failure ({self._broken}); "
                                  "call reconnect() first")
        if self._pg is None:
            raise WeightSyncError("weight sync is not connected: call connect() first")
        version = str(weight_version)
        t0 = time.monotonic()
        plan = plan_buckets(named_tensors, self.bucket_bytes)
        self._zero_copy = 0
        first = next(plan, None)  # before the session opens: an empty update changes nothing
        if first is None:
            raise ValueError("update() got no tensors")
        try:
            if self._sessions_may_be_open:  # engines without one answer 400, which is fine
                self._fanout.best_effort("/end_weight_update", {})
            self._fanout.all("/begin_weight_update", {}, "begin_weight_update")
            self._sessions_may_be_open = True
            buckets, nbytes = self._send_buckets(first, plan, version)
            self._fanout.all("/end_weight_update", {}, "end_weight_update")
            self._sessions_may_be_open = False
            self._verify(version)
        except BaseException as exc:
            # Engines keep their session open (SGLang and the reference engine generate nothing
            # inside one) and rank 0's group is torn down, so an engine still waiting in a
            # receive fails now instead of at its timeout. The next update ends those sessions.
            self._broken = f"{type(exc).__name__}: {exc}"
            self._drop_local_group()
            if not isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(
                f"weight update to version {version} failed: {exc}. Engines may hold partially updated "
                "weights under their old version: do not resume generation; reconnect() and push the "
                "whole update again, or stop the run.", exc.urls) from exc
        finally:
            self._pack_buffers.clear()
        dt = time.monotonic() - t0
        self.last_stats = {"buckets": buckets, "zero_copy_buckets": self._zero_copy, "bytes": nbytes,
                           "seconds": dt, "gbytes_per_s": nbytes / dt / 1e9 if dt > 0 else 0.0}
        log.info("weight version %s pushed: %d buckets, %.1f MB in %.2fs", version, buckets, nbytes / 1e6, dt)

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _send_buckets(self, items: Bucket, plan: Iterator[Bucket], version: str) -> tuple[int, int]:
        device = self._device()
        current = (items, *self._pack(items, device, 0))
        count = nbytes = 0
        while True:
            next_items = next(plan, None)
            last = next_items is None
            futures = self._start_bucket(*current, version if last else None)
            # packing the next bucket (into the other buffer) overlaps this bucket's broadcast
            following = None if last else (next_items, *self._pack(next_items, device, (count + 1) % 2))
            self._fanout.wait(futures, f"bucket {count} ({len(current[0])} tensors)", works=self._inflight)
            count += 1
            nbytes += sum(t.numel() * t.element_size() for t in current[1])
            if following is None:
                return count, nbytes
            current = following

    def _pack(self, items: Bucket, device: torch.device, slot: int) -> tuple[list[torch.Tensor], str | None]:
        """The tensors to broadcast for a bucket and the bucket's load format (module docstring).
        Flat: the tensors' own storage when they are one run on ``device`` (no copy), else one flat
        tensor packed into one of two reusable buffers per dtype (double buffering: one in flight,
        one being packed), so an update of many buckets touches fresh memory only twice. Per
        tensor: the tensors themselves (no copy when contiguous on ``device``)."""
        if self.load_format is not None:
            run = contiguous_run([t for _, t in items])
            if run is not None and run.device == device:
                self._zero_copy += 1
                return [run], FLATTENED
        if self.load_format is None or (self.load_format == "auto" and self.backend != "nccl"):
            return [t.detach().to(device).contiguous() for _, t in items], None
        dtype = items[0][1].dtype
        need = sum(t.numel() for _, t in items)
        if len(items) == 1:
            return [flatten_bucket(items, device)], FLATTENED
        buf = self._pack_buffers.get((slot, dtype))
        if buf is None or buf.numel() < need or buf.device != device:
            cap = max(need, self.bucket_bytes // max(1, items[0][1].element_size()))
            buf = self._pack_buffers[(slot, dtype)] = torch.empty(cap, dtype=dtype, device=device)
        return [flatten_bucket(items, device, out=buf)], FLATTENED

    def _start_bucket(self, items: Bucket, payload: list[torch.Tensor], load_format: str | None,
                      version: str | None) -> dict[str, Future]:
        fields: dict[str, Any] = {} if version is None else {"weight_version": version}
        body = wire(UpdateBucketRequest(
            names=[n for n, _ in items], dtypes=[dtype_name(t.dtype) for _, t in items],
            shapes=[list(t.shape) for _, t in items], group_name=self.group_name,
            load_format=load_format, flush_cache=version is not None, **fields))
        futures = self._fanout.each("/update_weights_from_distributed", body)
        # kept on self, not in a local: a traceback must not keep the group's sockets alive
        self._inflight.extend(dist.broadcast(t, src=0, group=self._pg, async_op=True) for t in payload)
        return futures

    def _verify(self, version: str) -> None:
        futures = {url: spawn(self._fanout.weight_version, url) for url in self._fanout.urls}
        self._fanout.wait(futures, "verify weight_version")
        wrong = {url: f.result() for url, f in futures.items() if f.result() != version}
        if wrong:
            raise WeightSyncError("engines report another weight_version after the update (expected "
                                  f"{version!r}): " + ", ".join(f"{u}: {v!r}" for u, v in wrong.items()),
                                  list(wrong))
