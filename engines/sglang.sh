#!/usr/bin/env bash
# SGLang's own environment for the live-engine tests and for `hstap serve --engine sglang --engine-python
# VENV/bin/python` on a CPU: sglang 0.5.20 (the last release pinning torch 2.13.0, the CPU wheel hstap uses) and
# exactly the packages its CPU engine imports (engines/sglang.txt, installed --no-deps: sglang's own requirement list
# is a CUDA stack), the stand-ins of engines/sglang-cpu (sgl_kernel, the torchvision start-up fix), and hstap itself
# (--no-deps: SGLang's workers import the capture hook factory). Then serve with
#   SGLANG_USE_CPU_ENGINE=1 hstap serve --engine sglang --engine-python VENV/bin/python --model smollm2 ... -- \
#       --device cpu --attention-backend torch_native --sampling-backend pytorch --disable-cuda-graph
#   UV=.venv/bin/uv bash engines/sglang.sh .venv-sglang   # ~15 s on 2 cores, 2.5 GB (torch and triton are most of it)
# uv, not pip, as in engines/vllm.sh (UV_FIND_LINKS names pip's wheel folder, where the CPU torch lies).
set -euo pipefail
VENV=${1:-.venv-sglang}
PY=${PY:-python3}
UV=${UV:-uv}
command -v "$UV" >/dev/null || { echo "engines/sglang.sh: needs uv (pip install uv, or run make engines)" >&2; exit 1; }
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$VENV"
$PY -m venv "$VENV"
"$UV" pip install -q -p "$VENV/bin/python" --no-deps -r "$HERE/sglang.txt"
# Built from a copy, so that the source tree gets no build/ or egg-info directory.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$HERE/sglang-cpu" "$tmp/"
"$UV" pip install -q -p "$VENV/bin/python" --no-deps "$tmp/sglang-cpu"
# A .pth runs at every start of this venv's Python (a wheel cannot install one): torchvision then imports.
cp "$HERE/sglang-cpu/hstap_sglang_cpu.pth" "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
"$UV" pip install -q -p "$VENV/bin/python" --no-deps -e "$HERE/.."
# What failed before the stand-ins (the torchvision import, an sgl_kernel name) and hstap's hook module; the live
# tests start the engine itself.
"$VENV/bin/python" -c "
import importlib.metadata as m, torchvision.io, hstap.capture.sglang
from sgl_kernel import copy_all_layer_kv_cache_cpu
print('sglang', m.version('sglang'), 'torch', m.version('torch'), 'ready in $VENV')"
touch "$VENV/.installed"
