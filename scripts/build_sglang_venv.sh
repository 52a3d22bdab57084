#!/usr/bin/env bash
# Build the separate virtual environment that runs the real SGLang 0.5.23 server on CPU for the
# `sglang` test tier:  bash scripts/build_sglang_venv.sh [VENV_DIR]   (default .venv-sglang)
#
# What it installs (and why):
#   - torch==2.14.1 + torchvision==0.29.1 (SGLang 0.5.23 pins torch 2.14.1 and imports torchvision
#     while loading the model config). From local disk where pip's find-links has them, PyPI otherwise.
#   - sglang==0.5.23 with --no-deps: its full dependency set pulls ~11 GB of CUDA-only packages
#     (flashinfer, deep-ep, flash-attn, ...). We add only the pure-Python packages it imports on the
#     CPU path, at the versions sglang 0.5.23 pins where it pins one.
#   - sglang-router 0.3.2 (the router binary; workers are added with POST /workers).
#   - tests/sglang/sglang_cpu: a TEST-ONLY pure-torch stand-in for the kernel package's CPU functions
#     (module `sgl_kernel`); the CPU build of the real package is not on PyPI. Never on GPU machines.
#
# Idempotent: a second run with the same recipe reuses the venv (checked by a stamp holding the
# recipe's hash, plus an import smoke test). Works without stdin (CI=true). Prints time and size.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-.venv-sglang}
python=${SGLANG_VENV_PYTHON:-python3.11}
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

torch_pkgs=("torch==2.14.1" "torchvision==0.29.1")
sglang_pkg="sglang==0.5.23"
router_pkg="sglang-router==0.3.2"
# Pure-Python (or small wheel) packages that sglang 0.5.23 imports when serving a dense model on CPU.
deps=(
  "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0" "xgrammar==0.2.7"
  "apache-tvm-ffi==0.1.11" "openai==2.8.0" "soundfile==0.13.1" "sentencepiece==0.2.1"
  "blobfile==3.0.0"
  aiohttp fastapi "uvicorn>=0.51" uvloop orjson "pyzmq>=25.1.2" psutil pydantic requests tqdm
  "prometheus-client>=0.20.0" python-multipart setproctitle msgspec pybase64 partial_json_parser
  einops interegular xxhash regex packaging numpy scipy pillow watchfiles zstandard distro
  IPython dill gguf jsonschema "python-dateutil<3" tiktoken
)
standin="$here/tests/sglang/sglang_cpu"
recipe=$(printf '%s\n' "$python" "${torch_pkgs[@]}" "$sglang_pkg" "$router_pkg" "${deps[@]}" \
         | cat - "$standin/pyproject.toml" "$standin/sgl_kernel/__init__.py" | sha256sum | cut -c1-16)
stamp="$venv/.headrace-sglang-recipe"

smoke() {
  SGLANG_USE_CPU_ENGINE=1 PYTHONWARNINGS=ignore "$venv/bin/python" - <<'EOF'
import importlib.metadata as md
import sgl_kernel, sglang, sglang_router, torch
import sglang.srt.entrypoints.http_server  # the import chain `python -m sglang.launch_server` runs
assert getattr(sgl_kernel, "IS_HEADRACE_STANDIN", False), "sgl_kernel is not the test stand-in"
assert torch.__version__.startswith("2.14.1"), torch.__version__
print("sglang", md.version("sglang"), "| sglang-router", md.version("sglang-router"), "| torch", torch.__version__)
EOF
}

report() {
  echo "build_sglang_venv: $1 $venv in $(( $(date +%s) - start ))s; size $(du -sh "$venv" | cut -f1)"
}

start=$(date +%s)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$recipe" ]] && smoke >/dev/null 2>&1; then
  report "reused"
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  command -v "$python" >/dev/null || { echo "build_sglang_venv: $python not found (SGLang 0.5.23 wheels here are for Python 3.11; set SGLANG_VENV_PYTHON)" >&2; exit 1; }
  "$python" -m venv "$venv"
fi
# pip's find-links / extra-index-url setup here prints one "Location ... is ignored" warning per
# package it does not carry; drop those, keep every other line.
pip_install() {
  "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v -e "^WARNING: Location '.*' is ignored" || true; }
}
rm -f "$stamp"
pip_install --upgrade pip
pip_install "${torch_pkgs[@]}"
# --no-deps: see the header. pip then reports sglang's uninstalled CUDA requirements; that is expected.
pip_install --no-deps "$sglang_pkg"
pip_install "${deps[@]}" "${torch_pkgs[@]}" | { grep -v -e "dependency resolver" -e "^sglang 0.5.23 requires" || true; }
pip_install "$router_pkg"
# build the stand-in from a copy, so no build/ or egg-info lands in the source tree
stage=$(mktemp -d)
cp -r "$standin/pyproject.toml" "$standin/sgl_kernel" "$stage/"
pip_install --force-reinstall --no-deps "$stage"
rm -rf "$stage"
smoke
echo "$recipe" > "$stamp"
report "built"
