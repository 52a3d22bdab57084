#!/usr/bin/env bash
# Placeholder until issue 6 lands: builds the SGLang venv (torch 2.14.1, sglang 0.5.23 --no-deps).
set -euo pipefail
venv=${1:-.venv-sglang}
echo "build_sglang_venv: not implemented yet; $venv not built" >&2
exit 0
