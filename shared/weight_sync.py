"""Weight sync, trainer side: push full Hugging Face-named tensors from trainer rank 0 to every
engine over one torch.distributed process group, through SGLang's weight-update HTTP API.

The group is {trainer rank 0} + every engine rank. Engine ``i`` (``world_size`` ranks, its TP
size) joins at ``rank_offset = 1 + sum(world_size of engines before it)``. Both sides join the way
SGLang's ``init_custom_process_group`` does (``join_update_group`` below, shared with the
reference engine's receiver): a ``tcp://master_address:master_port`` rendezvous whose store is
served by rank 0, wrapped in ``PrefixStore(group_name)``, and a new process group that is not the
default group. A plain ``init_process_group`` on the trainer side would not meet the engines.

``WeightSender.update`` guarantees:
- the update runs inside ``/begin_weight_update`` ... ``/end_weight_update`` on every engine;
- tensors go in buckets of one dtype and at most ``bucket_bytes`` each (a tensor larger than
  that gets a bucket of its own), in their given order within a dtype; one
  ``/update_weights_from_distributed`` request per bucket. With ``load_format="flattened_bucket"``
  (the default on NCCL) a bucket is broadcast as one flat tensor, the concatenation of the
  flattened tensors in ``names`` order, exactly what SGLang's receiver allocates; with ``None``
  (the default on gloo: on CPU the packing copy costs more than it saves, see
  bench/weight_sync_bench.py) each tensor is broadcast in ``names`` order, SGLang's default mode;
- for each bucket the metadata is posted to every engine concurrently (one thread per engine)
  while rank 0 broadcasts, so neither side waits on the other; packing the next bucket overlaps
  the current broadcast;
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

import datetime
import logging
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import httpx
import torch
import torch.distributed as dist

from headrace.shared.weight_buckets import dtype_name, flatten_bucket, parse_dtype, plan_buckets, unflatten_bucket

__all__ = [
    "WeightSyncError", "EngineTarget", "WeightSender", "engines_from_rollout", "join_update_group",
    "destroy_update_group", "plan_buckets", "flatten_bucket", "unflatten_bucket", "dtype_name",
    "parse_dtype",
]

log = logging.getLogger("headrace.weight_sync")
FLATTENED = "flattened_bucket"


class WeightSyncError(RuntimeError):
    """A weight-sync step failed. ``urls`` are the engines that failed (empty: the local side)."""

    def __init__(self, message: str, urls: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.urls = list(urls)


@dataclass
class EngineTarget:
    """One engine: its base URL and how many ranks it has in the group (its TP size)."""

    url: str
    world_size: int = 1

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"engine url must start with http:// or https://: {self.url!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"engine {self.url}: world_size must be an int >= 1, got {self.world_size!r}")


# ---- the process group --------------------------------------------------------------------------

def join_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                      group_name: str, backend: str = "gloo", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Join the weight-update group as SGLang's ``init_custom_process_group`` does: a tcp://
    rendezvous (rank 0 serves the store), the store wrapped in ``PrefixStore(group_name)``, a new
    non-default group of ``world_size`` ranks. Blocks until every rank joined or ``timeout_s``."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                    _world, rendezvous)
    if not group_name:
        raise ValueError("group_name must not be empty")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of world_size {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    host = f"[{master_address}]" if ":" in master_address else master_address
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_update_group(pg: dist.ProcessGroup | None) -> None:
    """Destroy a group made by join_update_group (no-op for None)."""
    if pg is not None:
        dist.destroy_process_group(pg)


def _destroy_last_refs(refs: list[Any]) -> None:
    """Destroy a group and drop the last references to it and its in-flight work, so its sockets
    close (peers still waiting in a receive then fail) in this thread, not the caller's."""
    pg, refs[0] = refs[0], None
    refs.clear()
    destroy_update_group(pg)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _spawn(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn`` in a daemon thread (a hung join must not keep the interpreter from exiting)."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="weight-sync").start()
    return fut


def engines_from_rollout(rollout_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> list[EngineTarget]:
    """The engines of a rollout service, from its ``GET /v1/engines`` (``[{"url","world_size"}]``)."""
    url = rollout_url.rstrip("/") + "/v1/engines"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise WeightSyncError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise WeightSyncError(f"GET {url}: {resp.status_code}: {resp.text[:500]}")
    body = resp.json()
    if isinstance(body, dict) and "engines" in body:
        body = body["engines"]
    if not isinstance(body, list) or not body:
        raise WeightSyncError(f"GET {url}: expected a non-empty list of engines, got {str(body)[:300]}")
    try:
        return [EngineTarget(url=e["url"], world_size=int(e.get("world_size", 1))) for e in body]
    except (KeyError, TypeError, ValueError) as exc:
        raise WeightSyncError(f"GET {url}: bad engine entry: {exc}") from exc


# ---- the sender ---------------------------------------------------------------------------------

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
        if load_format == "auto":  # measured on CPU: packing costs a copy that per-tensor sends avoid
            load_format = FLATTENED if backend == "nccl" else None
        self.load_format = load_format
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
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(headers=headers, timeout=self.timeout_s,
                                  limits=httpx.Limits(max_connections=4 * len(self.engines) + 4))
        self._pg: dist.ProcessGroup | None = None
        self._inflight: list[Any] = []  # the broadcasts of the current bucket (torch Work objects)
        self._pack_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # freed after each update
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
        self._destroy_stale_groups()
        port = self.master_port or free_port("" if self.master_address not in ("127.0.0.1", "localhost") else "127.0.0.1")
        futures = {
            e.url: _spawn(self._post, e.url, "/init_weights_update_group", {
                "master_address": self.master_address, "master_port": port, "rank_offset": off,
                "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend})
            for e, off in zip(self.engines, self.rank_offsets)}
        join = _spawn(join_update_group, self.master_address, port, 0, self.world_size, self.group_name,
                      self.backend, self.timeout_s)
        try:
            self._await(futures, f"init group {self.group_name!r}", local=join)
        except WeightSyncError:
            if join.done() and join.exception() is None:
                _spawn(destroy_update_group, join.result())
            raise
        self._pg = join.result()
        self._joined = True
        self._broken = None
        log.info("weight-sync group %s: %d ranks, %d engines, port %d", self.group_name, self.world_size,
                 len(self.engines), port)

    def _destroy_stale_groups(self) -> None:
        """A trainer that crashed (or a sender abandoned after a failure) leaves its group on the
        engines, and an engine refuses to join a second one of the same name: destroy it first.
        Engines without such a group answer 400, which is fine; a dead engine fails the init."""
        futures = [_spawn(self._post, e.url, "/destroy_weights_update_group", {"group_name": self.group_name},
                          min(self.timeout_s, 30.0)) for e in self.engines]
        wait_futures(futures, timeout=min(self.timeout_s, 30.0) + 1)

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
        futures = {e.url: _spawn(self._post, e.url, "/destroy_weights_update_group",
                                 {"group_name": self.group_name}, min(self.timeout_s, 30.0))
                   for e in self.engines}
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
        done = _spawn(_destroy_last_refs, [pg, inflight])
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
            self._http.close()

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
        first = next(plan, None)  # before the session opens: an empty update changes nothing
        if first is None:
            raise ValueError("update() got no tensors")
        try:
            if self._sessions_may_be_open:
                self._end_stale_sessions()
            self._all("/begin_weight_update", {}, "begin_weight_update")
            self._sessions_may_be_open = True
            buckets, nbytes = self._send_buckets(first, plan, version)
            self._all("/end_weight_update", {}, "end_weight_update")
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
        self.last_stats = {"buckets": buckets, "bytes": nbytes, "seconds": dt,
                           "gbytes_per_s": nbytes / dt / 1e9 if dt > 0 else 0.0}
        log.info("weight version %s pushed: %d buckets, %.1f MB in %.2fs", version, buckets, nbytes / 1e6, dt)

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _send_buckets(self, items: list[tuple[str, torch.Tensor]],
                      plan: Iterator[list[tuple[str, torch.Tensor]]], version: str) -> tuple[int, int]:
        device = self._device()
        current = (items, self._pack(items, device, 0))
        count = nbytes = 0
        while True:
            next_items = next(plan, None)
            last = next_items is None
            futures = self._start_bucket(*current, version if last else None)
            # packing the next bucket (into the other buffer) overlaps this bucket's broadcast
            following = None if last else (next_items, self._pack(next_items, device, (count + 1) % 2))
            self._await(futures, f"bucket {count} ({len(current[0])} tensors)", broadcast=True)
            count += 1
            nbytes += sum(t.numel() * t.element_size() for t in current[1])
            if following is None:
                return count, nbytes
            current = following

    def _pack(self, items: list[tuple[str, torch.Tensor]], device: torch.device, slot: int) -> list[torch.Tensor]:
        """The tensors to broadcast for a bucket: its tensors themselves (per-tensor mode, no copy
        when contiguous on ``device``), or one flat tensor packed into one of two reusable buffers
        per dtype (double buffering: one in flight, one being packed), so an update of many
        buckets touches fresh memory only twice."""
        if self.load_format is None:
            return [t.detach().to(device).contiguous() for _, t in items]
        dtype = items[0][1].dtype
        need = sum(t.numel() for _, t in items)
        if len(items) == 1:
            return [flatten_bucket(items, device)]
        buf = self._pack_buffers.get((slot, dtype))
        if buf is None or buf.numel() < need or buf.device != device:
            cap = max(need, self.bucket_bytes // max(1, items[0][1].element_size()))
            buf = self._pack_buffers[(slot, dtype)] = torch.empty(cap, dtype=dtype, device=device)
        return [flatten_bucket(items, device, out=buf)]

    def _start_bucket(self, items: list[tuple[str, torch.Tensor]], payload: list[torch.Tensor],
                      version: str | None) -> dict[str, Future]:
        body: dict[str, Any] = {
            "names": [n for n, _ in items], "dtypes": [dtype_name(t.dtype) for _, t in items],
            "shapes": [list(t.shape) for _, t in items], "group_name": self.group_name,
            "load_format": self.load_format, "flush_cache": version is not None}
        if version is not None:
            body["weight_version"] = version
        futures = {e.url: _spawn(self._post, e.url, "/update_weights_from_distributed", body)
                   for e in self.engines}
        # kept on self, not in a local: a traceback must not keep the group's sockets alive
        self._inflight = [dist.broadcast(t, src=0, group=self._pg, async_op=True) for t in payload]
        return futures

    def _verify(self, version: str) -> None:
        futures = {e.url: _spawn(self._weight_version, e.url) for e in self.engines}
        self._await(futures, "verify weight_version")
        wrong = {url: f.result() for url, f in futures.items() if f.result() != version}
        if wrong:
            raise WeightSyncError("engines report another weight_version after the update (expected "
                                  f"{version!r}): " + ", ".join(f"{u}: {v!r}" for u, v in wrong.items()),
                                  list(wrong))

    def _end_stale_sessions(self) -> None:
        """End a session a failed update (or an earlier trainer) left open; engines without one
        answer 400, which is fine. Errors here are ignored: begin reports a dead engine."""
        futures = [_spawn(self._post, e.url, "/end_weight_update", {}, min(self.timeout_s, 30.0))
                   for e in self.engines]
        wait_futures(futures, timeout=min(self.timeout_s, 30.0) + 1)

    # -- HTTP --

    def _all(self, path: str, body: dict[str, Any], what: str) -> None:
        self._await({e.url: _spawn(self._post, e.url, path, body) for e in self.engines}, what)

    def _post(self, url: str, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        return self._request("POST", url, path, body, timeout)

    def _request(self, method: str, url: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = None, ok_404: bool = False) -> dict[str, Any] | None:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            resp = self._http.request(method, url + path, json=body, timeout=timeout)
        except httpx.TimeoutException as exc:
            raise WeightSyncError(f"{url}{path}: no answer within {timeout:g}s", [url]) from exc
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{url}{path}: {type(exc).__name__}: {exc or 'connection failed'}", [url]) from exc
        if resp.status_code == 404 and ok_404:
            return None
        try:
            data = resp.json()
        except ValueError:
            data = {"message": resp.text[:500]}
        if resp.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            message = data.get("message") or data.get("detail") or data if isinstance(data, dict) else data
            raise WeightSyncError(f"{url}{path}: HTTP {resp.status_code}: {str(message)[:500]}", [url])
        return data if isinstance(data, dict) else {"result": data}

    def _weight_version(self, url: str) -> str | None:
        for path in ("/get_model_info", "/model_info", "/get_server_info"):
            data = self._request("GET", url, path, timeout=min(self.timeout_s, 30.0), ok_404=True)
            if data is not None and "weight_version" in data:
                v = data["weight_version"]
                return None if v is None else str(v)
        raise WeightSyncError(f"{url}: neither /get_model_info, /model_info nor /get_server_info reports "
                              "weight_version", [url])

    # -- waiting --

    def _await(self, futures: dict[str, Future], what: str, *, broadcast: bool = False,
               local: Future | None = None) -> None:
        """Wait for every engine's answer (and the in-flight broadcast or the ``local`` future),
        raising WeightSyncError at the first failure or after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        pending = dict(futures)
        while True:
            waiting = list(pending.values()) + ([local] if local is not None else [])
            if waiting:
                wait_futures(waiting, timeout=0.002 if broadcast else 0.05, return_when="FIRST_COMPLETED")
            elif broadcast:
                time.sleep(0.0005)
            for url, fut in list(pending.items()):
                if fut.done():
                    exc = fut.exception()
                    if exc is not None:
                        raise exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"{what}: {url}: {exc}", [url])
                    del pending[url]
            if local is not None and local.done():
                exc = local.exception()
                if exc is not None:
                    self._raise_with_culprits(pending, f"{what}: trainer rank 0 failed: {exc}", deadline)
                local = None
            if broadcast and all(w.is_completed() for w in self._inflight):
                try:
                    for w in self._inflight:
                        w.wait()
                except Exception as exc:  # noqa: BLE001 - gloo/nccl errors name no engine
                    self._raise_with_culprits(pending, f"{what}: broadcast failed: {exc}", deadline)
                broadcast, self._inflight = False, []
            if not pending and not broadcast and local is None:
                return
            if time.monotonic() > deadline:
                urls = list(pending) or [e.url for e in self.engines]
                raise WeightSyncError(f"{what}: timed out after {self.timeout_s:g}s waiting for "
                                      f"{', '.join(pending) or 'the broadcast'}", urls)

    def _raise_with_culprits(self, pending: dict[str, Future], message: str, deadline: float) -> None:
        """A local failure names no engine: give the engines' answers a moment to say which one broke."""
        if pending:
            wait_futures(list(pending.values()), timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            for url, fut in pending.items():
                if fut.done() and fut.exception() is not None:
                    raise WeightSyncError(f"{message}; {fut.exception()}", [url])
        raise WeightSyncError(message, list(pending) or [e.url for e in self.engines])
