"""Where ``/update_weights_from_disk`` may read: below the model directory and the
``--allowed-weight-dirs``, nowhere else.

Guarantees:
- A path is compared after ``resolve()`` (``..`` and every symlink followed), so neither a
  ``../`` nor a symlink planted in an allowed directory leads outside; the same holds for every
  file a disk load opens: the ``*.safetensors`` files found and the file names of
  ``model.safetensors.index.json``'s ``weight_map``.
- A refusal is ``Refused`` with one fixed message that names no path: the answer is the same
  whether the path exists or not, so it cannot be used to probe the file system.
- The directories the served model's own weight files really live in (an HF cache snapshot's
  files are symlinks into its ``blobs/``) are allowed too: reloading the served model works.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

__all__ = ["Refused", "WeightDirs", "REFUSED"]

REFUSED = ("model_path is outside the directories this engine may load weights from "
           "(the model directory and --allowed-weight-dirs)")


class Refused(PermissionError):
    """A path outside the allowed directories (HTTP 403 with ``REFUSED``)."""

    def __init__(self) -> None:
        super().__init__(REFUSED)


class WeightDirs:
    """The allowed roots, resolved once at start-up."""

    def __init__(self, model_dir: str | Path, allowed: Iterable[str | Path] = ()) -> None:
        roots = [Path(model_dir).resolve(), *(Path(a).resolve() for a in allowed)]
        try:
            roots += [f.parent for f in safetensors_files(roots[0])]
        except (OSError, ValueError):
            pass
        self.roots = list(dict.fromkeys(roots))

    def allows(self, path: Path) -> bool:
        return any(path == r or path.is_relative_to(r) for r in self.roots)

    def check(self, path: str | Path) -> Path:
        """The resolved directory, or ``Refused``."""
        p = Path(path)
        if "\x00" in str(path):
            raise Refused()
        try:
            p = p.resolve()
        except (OSError, RuntimeError):     # a symlink loop
            raise Refused() from None
        if not self.allows(p):
            raise Refused()
        return p

    def load(self, path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) from the safetensors files of an allowed directory; ``Refused`` for a
        directory or a file outside the allowed ones (checked for every file before any is read)."""
        from safetensors import safe_open

        files = safetensors_files(self.check(path))
        for f in files:
            if not self.allows(f):
                raise Refused()
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name)


def safetensors_files(d: Path) -> list[Path]:
    """The resolved weight files of a directory (the index's ``weight_map`` values, else
    ``*.safetensors``); ValueError / FileNotFoundError when there are none or the index is bad."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"].values()
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError("model.safetensors.index.json has no weight_map object") from None
        if not all(isinstance(n, str) and n and "\x00" not in n for n in names):
            raise ValueError("model.safetensors.index.json: weight_map values must be file names")
        files = sorted(set(names))
    else:
        files = sorted(f.name for f in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{d}: no *.safetensors files")
    return [(d / f).resolve() for f in files]
