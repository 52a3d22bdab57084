"""The run token (DESIGN.md "Trust: one token, every service"): one bearer secret that every
Headrace HTTP service checks and every client sends.

Where the token lives: ``auth.token``, filled from ``HEADRACE_TOKEN`` or ``auth.token_file``
(``--token-file`` on every serve command) by ``shared.config.load_config``. Headrace writes it
nowhere: a saved config holds ``REDACTED`` in its place, children get it through their
environment (``child_env``), and ``--token`` is refused (``ps`` shows command lines to every user).

Guarantees of ``BearerAuth`` / ``Guard``:
- with a token, a request without ``Authorization: Bearer <token>`` (missing, empty, another
  scheme, another token) is answered 401 with a JSON ``{"detail": ...}`` and never reaches the
  app; the token is compared in constant time (``hmac.compare_digest``);
- ``/health`` is always open, ``/metrics`` unless ``auth.protect_metrics``; every other path,
  including ones no route serves, needs the token (a new endpoint is covered without a line here);
- without a token the guard lets everything through; ``bind_refusal`` is what keeps such a
  service on loopback unless the operator says ``--insecure``.

Nothing here imports torch or a service; ``starlette`` is imported only by the middleware.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from typing import Any, Mapping

TOKEN_ENV = "HEADRACE_TOKEN"
REDACTED = "***"
TOKEN_FLAG_REFUSED = ("--token is refused: a command line is visible to every user of the machine (ps); "
                      "put the token in a file and pass --token-file F, or set HEADRACE_TOKEN")
_DENIED = json.dumps({"detail": "missing or wrong bearer token (Authorization: Bearer <auth.token>)"}).encode()


def token_env(token: str | None) -> dict[str, str]:
    """The environment entries that hand ``token`` to a child process (empty without a token)."""
    return {TOKEN_ENV: token} if token else {}


def bearer_headers(token: str | None) -> dict[str, str]:
    """HTTP headers that carry ``token`` (empty without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a service reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, token: str | None, insecure: bool) -> str | None:
    """The message a serve command exits with when it would bind ``host`` beyond loopback with no
    token (None when binding is fine)."""
    if token or insecure or is_loopback(host):
        return None
    return (f"binding {host} without auth.token lets any host replace the engines' weights; "
            "set HEADRACE_TOKEN or pass --insecure")


class Guard:
    """The bearer check on one ASGI ``scope``; ``deny`` sends the 401."""

    def __init__(self, token: str | None, protect_metrics: bool = False) -> None:
        self.expected = token.encode() if token else None
        self.open_paths = {"/health"} if protect_metrics else {"/health", "/metrics"}

    @classmethod
    def of(cls, auth: Any) -> "Guard":
        """The guard of an ``AuthConfig`` (None: no token)."""
        return cls(auth.token, auth.protect_metrics) if auth is not None else cls(None)

    @property
    def active(self) -> bool:
        return self.expected is not None

    def allows(self, scope: Mapping[str, Any]) -> bool:
        if self.expected is None or scope.get("path") in self.open_paths:
            return True
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, credential = header.partition(b" ")
        # compare even for a wrong scheme, so the time taken says nothing about the header
        same = hmac.compare_digest(credential, self.expected)
        return same and scheme.lower() == b"bearer"

    async def deny(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_DENIED)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _DENIED})


class BearerAuth:
    """Pure ASGI middleware around an app: ``app.add_middleware(BearerAuth, guard=Guard(...))``."""

    def __init__(self, app: Any, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and not self.guard.allows(scope):
            await self.guard.deny(scope, receive, send)
            return
        await self.app(scope, receive, send)


def protect(app: Any, auth: Any) -> None:
    """Install the bearer check of ``auth`` (an ``AuthConfig`` or None) on a Starlette/FastAPI app."""
    guard = Guard.of(auth)
    if guard.active:
        app.add_middleware(BearerAuth, guard=guard)


def module_argv(python: str, module: str, args: list[str], token: str | None, flag: str = "--api-key") -> list[str]:
    """``python -m module args``, plus ``flag <token>`` taken from the child's HEADRACE_TOKEN when a
    token is set (start the child with ``token_env(token)``). SGLang (0.5.23) and sglang-router
    (0.3.2) take their key only as ``--api-key``: ``shared/secret_launch.py`` (run with ``-c``: the
    child's python is another venv's) appends it inside the child's own ``sys.argv``, so the OS
    command line never holds it, and masks it in the child's output (SGLang logs its arguments)."""
    if not token:
        return [python, "-m", module, *args]
    from pathlib import Path

    launcher = (Path(__file__).parent / "secret_launch.py").read_text().split('"""', 2)[2].strip()  # no docstring
    return [python, "-c", launcher, module, flag, *args]


def read_token_file(path: str, what: str = "--token-file") -> str:
    """The token in ``path`` (surrounding whitespace stripped); ValueError naming ``what`` and the path."""
    from pathlib import Path

    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} {path}: not a text file") from None
    if not text:
        raise ValueError(f"{what} {path} is empty")
    return text


def flag_token(token_flag: str | None, token_file: Any) -> str | None:
    """The token a serve command's flags give (``--token-file``), or None; ValueError for
    ``--token`` (refused: see ``TOKEN_FLAG_REFUSED``) or an unreadable / empty file."""
    if token_flag is not None:
        raise ValueError(TOKEN_FLAG_REFUSED)
    return read_token_file(str(token_file)) if token_file is not None else None
