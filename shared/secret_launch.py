"""Run ``python -m MODULE ARGS FLAG <token>`` with the token out of the command line and the output.

Usage (what ``shared.auth.module_argv`` builds; this file's text goes in ``-c``, because the
interpreter is another venv's, SGLang's, where Headrace is not installed)::

    python -c "<this file>" MODULE FLAG ARGS...      # with HEADRACE_TOKEN in the environment

SGLang 0.5.23 and sglang-router 0.3.2 take their key only as ``--api-key``: it is appended to
``sys.argv`` inside this process, so ``/proc/<pid>/cmdline`` and ``ps`` never show it, and the module
then runs as ``python -m`` would run it. SGLang logs its ``server_args`` (key included) at start-up;
file descriptors 1 and 2 go through a pipe that replaces the token with ``***`` line by line, so the
log the launcher writes never holds it (child processes inherit the same pipe). Only the standard
library is used.
"""

import atexit
import os
import runpy
import sys
import threading


def _redact_fds(secret: bytes) -> None:
    read, write = os.pipe()
    out = os.dup(1)
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)

    def pump() -> None:
        rest = b""
        while True:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            rest += chunk
            lines, _, rest = rest.rpartition(b"\n")
            if len(rest) > 1 << 20:      # a huge line without a newline: pass it on
                lines, rest = lines + b"\n" + rest, b""
            if lines:
                os.write(out, lines.replace(secret, b"***") + b"\n")
        if rest:
            os.write(out, rest.replace(secret, b"***"))

    t = threading.Thread(target=pump, name="redact-output", daemon=True)
    t.start()

    def drain() -> None:   # at exit: let the pump pass on what is still in the pipe
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except (OSError, ValueError):
                pass
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        t.join(2.0)

    atexit.register(drain)


def main() -> None:
    module, flag = sys.argv[1], sys.argv[2]
    secret = os.environ["HEADRACE_TOKEN"]
    _redact_fds(secret.encode())
    sys.argv = [module, *sys.argv[3:], flag, secret]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":   # under ``python -c`` too
    main()
