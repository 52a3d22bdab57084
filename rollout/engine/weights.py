"""Weight sync, engine side: join the trainer's weight-update group and receive broadcast tensors,
with SGLang 0.5.23's HTTP semantics.

- ``WeightReceiver`` joins the group as rank ``rank_offset + tp_rank`` exactly as SGLang's
  ``init_custom_process_group`` does (``shared.weight_sync.join_update_group``: tcp:// rendezvous
  served by rank 0, ``PrefixStore(group_name)``, a new non-default group) and receives either one
  broadcast per tensor from rank 0 in ``names`` order, or one flat tensor
  (``load_format="flattened_bucket"``: the tensors flattened and concatenated in ``names`` order,
  all of one dtype). Tensors land in a receive buffer kept per dtype while the group lives (the
  returned views are valid until the next receive) or, per tensor, straight into the engine's own
  weights when a ``dest`` lookup is given. Every call blocks; HTTP handlers run them in a worker
  thread.
- ``WeightUpdateService`` is the state machine behind the five endpoints, minus HTTP:
  ``/update_weights_from_distributed`` outside a ``/begin_weight_update`` ... ``/end_weight_update``
  session is a 400; updates are serialised; the engine's ``weight_version`` changes only when an
  update that carries one has been received and loaded completely. A failed update answers
  ``success: false`` and leaves the version as it was (the sender then treats the weights as
  partial and must push a whole update again).
- ``add_weight_routes(app, service)`` mounts those endpoints on a FastAPI app (the reference
  engine's, or the standalone receiver below); blocking work runs off the event loop.
- ``python -m headrace.rollout.engine.weights --port P`` serves a standalone receiver holding a plain dict of
  tensors (used by tests and bench/weight_sync_bench.py): the weight endpoints plus
  ``/get_model_info``, ``/health`` and ``GET /weights_digest`` (sha256 of each tensor's bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import threading
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from starlette.requests import Request
from starlette.responses import JSONResponse

from headrace.shared.weight_sync import FLATTENED, destroy_update_group, join_update_group, parse_dtype, unflatten_bucket

__all__ = ["WeightReceiver", "WeightUpdateService", "add_weight_routes", "make_receiver_app"]

LoadFn = Callable[[list[tuple[str, torch.Tensor]]], None]


class WeightReceiver:
    """One engine rank's membership in the weight-update group."""

    def __init__(self, device: str | torch.device = "cpu", tp_rank: int = 0) -> None:
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.group_name: str | None = None
        self._pg: dist.ProcessGroup | None = None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    @property
    def connected(self) -> bool:
        return self._pg is not None

    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None:
        """Join as rank ``rank_offset + tp_rank``; blocks until all ranks joined (or timeout)."""
        if self._pg is not None:
            raise RuntimeError(f"already in weight-update group {self.group_name!r}; destroy it first")
        if rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (rank 0 is the trainer), got {rank_offset}")
        self._pg = join_update_group(master_address, int(master_port), rank_offset + self.tp_rank,
                                     int(world_size), group_name, backend, timeout_s)
        self.group_name = group_name

    def receive(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                load_format: str | None = None,
                dest: Callable[[str], torch.Tensor | None] | None = None) -> list[tuple[str, torch.Tensor]]:
        """Receive the tensors rank 0 broadcasts for this request, in ``names`` order. They come
        back as views of a receive buffer (one per dtype) that the next call reuses: copy them (as
        ``load_weights`` does) before receiving again.

        ``dest`` (per-tensor mode only): ``dest(name)`` may return the engine's own tensor for that
        name; when it is contiguous with the announced dtype, shape and device the tensor is
        received straight into it (no load copy; the returned pair holds that very tensor, so a
        loader can skip it by ``data_ptr``). Only inside an update session: a failed receive then
        leaves those weights partially written, like any failed update."""
        if self._pg is None:
            raise RuntimeError("not in a weight-update group: call init_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}")
        if not names:
            raise ValueError("names is empty")
        torch_dtypes = [parse_dtype(d) for d in dtypes]
        for name, shape in zip(names, shapes):
            if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"{name}: shape must be a list of ints >= 0, got {shape!r}")
        if load_format == FLATTENED:
            if len(set(torch_dtypes)) != 1:
                raise ValueError(f"a flattened bucket holds one dtype, got {sorted(set(map(str, dtypes)))}")
            total = sum(_numel(s) for s in shapes)
            flat = self._buffer(torch_dtypes[0], total)
            dist.broadcast(flat, src=0, group=self._pg)
            return unflatten_bucket(flat, names, shapes)
        if load_format not in (None, "auto"):
            raise ValueError(f"unsupported load_format {load_format!r} (None or {FLATTENED!r})")
        totals: dict[torch.dtype, int] = {}
        for d, shape in zip(torch_dtypes, shapes):
            totals[d] = totals.get(d, 0) + _numel(shape)
        flats = {d: self._buffer(d, n) for d, n in totals.items()}
        offsets = dict.fromkeys(totals, 0)
        out = []
        for name, d, shape in zip(names, torch_dtypes, shapes):
            n = _numel(shape)
            own = dest(name) if dest is not None else None
            if (own is not None and own.dtype == d and list(own.shape) == list(shape) and own.is_contiguous()
                    and own.device == self.device):
                out.append((name, own))
                continue
            out.append((name, flats[d][offsets[d]:offsets[d] + n].view(*shape)))
            offsets[d] += n
        works = [dist.broadcast(t, src=0, group=self._pg, async_op=True) for _, t in out]
        for w in works:
            w.wait()
        return out

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The front of a receive buffer kept per dtype (grown as needed), so a many-bucket update
        does not fault in fresh pages for every bucket."""
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel]

    def release_buffers(self) -> None:
        """Free the receive buffers (they are also freed by destroy())."""
        self._buffers.clear()

    def destroy(self) -> None:
        """Leave and destroy the group (no-op when not in one)."""
        self._buffers.clear()
        pg, self._pg = self._pg, None
        self.group_name = None
        destroy_update_group(pg)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class WeightUpdateService:
    """Engine-side semantics of SGLang's weight-update endpoints. Methods take the request body as a
    dict and return ``(status, body)``; they block (run them in a worker thread). ``load_weights``
    gets ``[(hf_name, tensor)]`` per request and must copy what it keeps (tensors may be views of
    one receive buffer) and keep generation away from half-loaded weights."""

    def __init__(self, load_weights: LoadFn, *, weight_version: str = "default",
                 device: str | torch.device = "cpu", tp_rank: int = 0, timeout_s: float = 300.0,
                 dest: Callable[[str], torch.Tensor | None] | None = None) -> None:
        self.load_weights = load_weights
        self.dest = dest
        self.weight_version = weight_version
        self.receiver = WeightReceiver(device, tp_rank)
        self.timeout_s = timeout_s
        self.in_session = False
        self._lock = threading.Lock()  # one update / group change at a time

    def init_group(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        try:
            args = dict(master_address=str(body["master_address"]), master_port=int(body["master_port"]),
                        rank_offset=int(body["rank_offset"]), world_size=int(body["world_size"]),
                        group_name=str(body.get("group_name", "weight_update_group")),
                        backend=str(body.get("backend", "nccl")))
        except (KeyError, TypeError, ValueError) as exc:
            return 400, _fail(f"bad init_weights_update_group request: {type(exc).__name__}: {exc}")
        with self._lock:
            try:
                self.receiver.init_group(**args, timeout_s=float(body.get("timeout_s", self.timeout_s)))
            except Exception as exc:  # noqa: BLE001 - answered to the caller
                return 400, _fail(f"Failed to init group: {exc}")
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def begin(self, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self.in_session:
                return 400, _fail("a weight update session is already open")
            self.in_session = True
        return 200, {"success": True, "message": "weight update session opened"}

    def update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if not self.in_session:
            return 400, _fail("update_weights_from_distributed outside a begin_weight_update ... "
                              "end_weight_update session")
        with self._lock:
            group = body.get("group_name", "weight_update_group")
            if not self.receiver.connected or group != self.receiver.group_name:
                return 400, _fail(f"group {group!r} not initialized (have {self.receiver.group_name!r}); "
                                  "call init_weights_update_group first")
            try:
                tensors = self.receiver.receive(body["names"], body["dtypes"], body["shapes"], body.get("load_format"),
                                                dest=self.dest)
                self.load_weights(tensors)
            except Exception as exc:  # noqa: BLE001 - answered to the caller
                return 400, _fail(f"Failed to update parameter online: {type(exc).__name__}: {exc}. The weights "
                                  "are partially updated; discard them or push a whole update again.")
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return 200, {"success": True, "message": f"Succeeded to update {len(tensors)} tensors online."}

    def end(self, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if not self.in_session:
                return 400, _fail("end_weight_update without begin_weight_update")
            self.in_session = False
        return 200, {"success": True, "message": "weight update session closed"}

    def destroy(self, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        group = (body or {}).get("group_name", "weight_update_group")
        with self._lock:
            if not self.receiver.connected or group != self.receiver.group_name:
                return 400, _fail("The group to be destroyed does not exist.")
            try:
                self.receiver.destroy()
            except Exception as exc:  # noqa: BLE001
                return 400, _fail(f"Failed to destroy custom process group: {exc}.")
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def _fail(message: str) -> dict[str, Any]:
    return {"success": False, "message": message}


def add_weight_routes(app: Any, service: WeightUpdateService) -> None:
    """Mount the five weight-update endpoints on a FastAPI ``app``; blocking calls run in threads."""
    def route(path: str, method: Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]) -> None:
        async def handler(request: Request) -> JSONResponse:
            raw = await request.body()
            try:
                body = await request.json() if raw else {}
            except ValueError:
                return JSONResponse(_fail("body is not JSON"), status_code=400)
            if not isinstance(body, dict):
                return JSONResponse(_fail("body must be a JSON object"), status_code=400)
            status, answer = await asyncio.to_thread(method, body)
            return JSONResponse(answer, status_code=status)

        app.add_api_route(path, handler, methods=["POST"])

    route("/init_weights_update_group", service.init_group)
    route("/begin_weight_update", service.begin)
    route("/update_weights_from_distributed", service.update)
    route("/end_weight_update", service.end)
    route("/destroy_weights_update_group", service.destroy)


def make_receiver_app(tensors: dict[str, torch.Tensor] | None = None, *, timeout_s: float = 300.0,
                      in_place: bool = False) -> Any:
    """A standalone receiver: a FastAPI app whose "model" is a dict of tensors (tests, benchmarks).
    ``in_place``: per-tensor updates are received straight into the stored tensors."""
    from fastapi import FastAPI

    store: dict[str, torch.Tensor] = {} if tensors is None else tensors

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            dst = store.get(name)
            if dst is not None and dst.data_ptr() == t.data_ptr() and dst.shape == t.shape:
                continue  # received in place
            if dst is not None and dst.shape == t.shape and dst.dtype == t.dtype:
                dst.copy_(t)
            else:
                store[name] = t.clone()

    service = WeightUpdateService(load, timeout_s=timeout_s, dest=store.get if in_place else None)
    app = FastAPI(title="headrace weight receiver")
    app.state.service, app.state.tensors = service, store
    add_weight_routes(app, service)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "receiver", "weight_version": service.weight_version}

    @app.get("/weights_digest")
    async def digest() -> dict[str, str]:
        return await asyncio.to_thread(lambda: {n: tensor_digest(t) for n, t in store.items()})

    return app


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="standalone weight receiver (SGLang weight-update API subset)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--in-place", action="store_true", help="receive per-tensor updates into the stored tensors")
    args = parser.parse_args(argv)
    import uvicorn
    torch.set_num_threads(1)
    uvicorn.run(make_receiver_app(timeout_s=args.timeout_s, in_place=args.in_place), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
