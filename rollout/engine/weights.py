"""A standalone weight receiver: the weight-update endpoints of SGLang 0.5.23 (the engine's own
``UpdateSession``, ``weight_routes``) over a "model" that is a plain dict of tensors, for tests and
bench/weight_sync_bench.py.

``python -m headrace.rollout.engine.weights --port P [--in-place]`` serves it: the five weight
endpoints plus ``/get_model_info`` (its weight_version), ``/health`` and ``GET /weights_digest``
(sha256 of each tensor's bytes). ``--in-place``: per-tensor updates are received straight into the
stored tensors (no load copy). With ``HEADRACE_TOKEN`` set, every endpoint but /health needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
from typing import Any, Sequence

import torch

from headrace.rollout.engine.session import UpdateSession
from headrace.rollout.engine.weight_routes import add_weight_routes

__all__ = ["DictTarget", "make_receiver_app", "tensor_digest"]


class DictTarget:
    """A ``WeightTarget`` whose model is a dict of tensors; it generates nothing."""

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, *, in_place: bool = False,
                 weight_version: str = "default") -> None:
        self.tensors: dict[str, torch.Tensor] = {} if tensors is None else tensors
        self.in_place = in_place
        self.weight_version = weight_version

    def set_updating(self, updating: bool) -> None:
        pass

    def param_view(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name) if self.in_place else None

    def load(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        for name, t in named:
            dst = self.tensors.get(name)
            if dst is not None and dst.data_ptr() == t.data_ptr() and dst.shape == t.shape:
                continue  # received in place
            if dst is not None and dst.shape == t.shape and dst.dtype == t.dtype:
                dst.copy_(t)
            else:
                self.tensors[name] = t.clone()
        if version is not None:
            self.weight_version = version

    def abort_all(self, reason: str) -> None:
        pass

    def flush_cache(self) -> None:
        pass


def make_receiver_app(tensors: dict[str, torch.Tensor] | None = None, *, timeout_s: float = 300.0,
                      in_place: bool = False) -> Any:
    """The standalone receiver's FastAPI app (``app.state.session``, ``app.state.target``)."""
    from fastapi import FastAPI

    target = DictTarget(tensors, in_place=in_place)
    session = UpdateSession(target, timeout_s=timeout_s)
    app = FastAPI(title="headrace weight receiver")
    app.state.session, app.state.target = session, target
    add_weight_routes(app, session)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": "receiver", "weight_version": target.weight_version}

    @app.get("/weights_digest")
    async def digest() -> dict[str, str]:
        return await asyncio.to_thread(lambda: {n: tensor_digest(t) for n, t in target.tensors.items()})

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
    import os

    import uvicorn

    from headrace.shared.auth import TOKEN_ENV, BearerAuth, Guard
    torch.set_num_threads(1)
    app = make_receiver_app(timeout_s=args.timeout_s, in_place=args.in_place)
    if os.environ.get(TOKEN_ENV):   # the run token, as on the engine: every endpoint but /health needs it
        app.add_middleware(BearerAuth, guard=Guard(os.environ[TOKEN_ENV]))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
