"""vLLM's CUDA paths on one lent GPU (issue 40, item 9): what tests/live proves on the CPU build, on a CUDA vLLM.

    python3 lab/gpu_vllm.py --out /tmp/vllm-gpu [--data jsonl:FILE]     (run by lab/gpu_vllm.sh on the device)

1. EAGLE-3 train/serve parity with CUDA graphs and torch.compile on (vLLM's defaults; no --enforce-eager): the
   reference drafter exported by `hstap export --format vllm`, served by vLLM (bf16, a chain of 3) on the first turns
   of 16 MT-bench questions, one request at a time, greedy, 128 tokens; vLLM's τ from its Prometheus counters
   against hstap's drafter replayed on vLLM's own answers (fp32 target on the CPU), with the tolerance and the
   layer-one-off check of tests/live/test_vllm_eagle.py. Then bench/engine_speedup.py: vLLM's own speedup from
   hstap's drafter on the 80 MT-bench questions.
2. Capture through vLLM's extract_hidden_states route with CUDA graphs and torch.compile on, fp32, 128-token
   scheduler chunks: `hstap compare` against `hstap capture` (transformers, fp32, CPU) at bf16's own tolerance.
3. The same conversations through hstap's worker extension (eager: its hooks need it), compared the same way and
   with the extract route's store.

Everything goes to OUT/log and OUT/results.json; each step is independent (one failing does not stop the next).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HSTAP_VLLM_PYTHON", sys.executable)  # the engine runs in this interpreter on the device

import tests.live.test_vllm_eagle as eagle  # noqa: E402
from tests.live.conftest import hstap, hstap_serve  # noqa: E402

GPU_MEMORY = ["--gpu-memory-utilization", "0.3"]  # SmolLM2 needs little; leaves the card for the replay's target
GPU_MEMORY += os.environ.get("LAB_VLLM_ARGS", "").split()  # a dry run on the CPU build: --enforce-eager
CAPTURE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--max-num-batched-tokens", "128",
                "--max-num-seqs", "8", *GPU_MEMORY]
CONVERSATIONS, MAX_TOKENS = 8, 512


def say(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def step_eagle(out: Path) -> dict:
    from hstap.evaluate.run import load_prompts
    from hstap.models import load_tokenizer

    prompts = load_prompts("mt-bench", load_tokenizer("smollm2"), eagle.PROMPTS)
    export = out / "export"
    done = hstap("export", "--drafter", "reference", "--format", "vllm", "--out", str(export))
    assert done.returncode == 0, done.stderr
    eagle.VLLM_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", *GPU_MEMORY]  # graphs and compile on
    t0 = time.monotonic()
    run = eagle.serve_and_ask(export, out / "serve-eagle", prompts)
    say(f"EAGLE-3 server: start {run.seconds['start']:.0f} s, 16 requests {run.seconds['requests']:.1f} s, "
        f"aux layers {run.aux_layers}")
    replay = eagle.make_replay()  # the live test's replay: hstap's drafter along vLLM's answers, fp32, CPU
    tau_v, tau_h, tol = eagle.parity(run, replay(prompts, run.answers, eagle.CANONICAL))
    _, tau_off, tol_off = eagle.parity(run, replay(prompts, run.answers, eagle.ONE_OFF))
    say(f"vLLM τ {tau_v:.3f} (mean acceptance length {run.mean_acceptance_length():.3f}); hstap replay {tau_h:.3f} "
        f"± {tol:.3f} -> {'PASS' if abs(tau_v - tau_h) <= tol else 'FAIL'}; fed {eagle.ONE_OFF}: {tau_off:.3f} "
        f"-> {'caught' if abs(tau_v - tau_off) > tol_off else 'NOT caught'}")
    # vLLM's speedup from the drafter: bench/engine_speedup.py on the same machine (80 prompts, CUDA graphs on)
    bench = subprocess.run([sys.executable, str(ROOT / "bench" / "engine_speedup.py"), "--device", "cuda",
                            "--engine-python", sys.executable, "--prompts", "80", "--work", str(out / "speedup"),
                            "--out", str(out / "engine_speedup.json")], capture_output=True, text=True)
    say(bench.stdout[-2000:] + bench.stderr[-3000:])
    return {"tau_vllm": tau_v, "mean_acceptance_length": run.mean_acceptance_length(), "tau_replay": tau_h,
            "tolerance": tol, "tau_replay_one_off": tau_off, "tolerance_one_off": tol_off,
            "aux_layers": run.aux_layers, "forwards": sum(run.drafts), "seconds": run.seconds,
            "speedup_exit": bench.returncode, "wall": time.monotonic() - t0}


def compare(a: Path, b: Path, *tol: str) -> dict:
    done = hstap("compare", str(a), str(b), "--json", *tol)
    verdict = json.loads(done.stdout) if done.stdout.strip().startswith("{") else {"raw": done.stdout + done.stderr}
    tensors = verdict.get("tensors", {})
    say(f"compare {a.name} {b.name}: exit {done.returncode} {verdict.get('status')} "
        + ", ".join(f"{k} rel {v['max_rel']:.2e} cos {v['min_cos']:.6f}" for k, v in tensors.items()))
    return {"exit": done.returncode, **verdict}


def step_capture(out: Path, data: str, route: str, reference: Path) -> dict:
    cap = out / f"cap-{route}"
    t0 = time.monotonic()
    with hstap_serve("vllm", out / f"serve-{route}", "--model", "smollm2", "--vllm-route", route, "--capture-dir",
                     str(cap), "--capture-layers", "auto", "--stall-timeout", "600", "--", *CAPTURE_ARGS,
                     ready_timeout=900) as served:
        ready = time.monotonic()
        remote = hstap("capture-remote", "--url", served.url, "--data", data, "--limit", str(CONVERSATIONS),
                       "--max-tokens", str(MAX_TOKENS), "--capture-dir", str(cap), "--concurrency", "1",
                       "--vllm-route", route)
        took = time.monotonic() - ready
        log = served.output()
    say(f"{route}: start {ready - t0:.0f} s, capture-remote exit {remote.returncode} in {took:.1f} s")
    if remote.returncode != 0:
        say(remote.stdout[-3000:] + remote.stderr[-3000:])
    graphs = [line for line in log.splitlines() if "CUDA graph" in line or "cudagraph" in line.lower()][-3:]
    return {"start": ready - t0, "capture_seconds": took, "exit": remote.returncode, "graph_lines": graphs,
            "compare_transformers": compare(cap, reference, "--rtol", "1e-9", "--min-cos", "1")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", default="sharegpt")
    parser.add_argument("--steps", default="eagle,extract,extension")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = args.out / "results.json"

    def save() -> None:
        path.write_text(json.dumps(results, indent=2, default=str) + "\n")

    steps = args.steps.split(",")
    reference = args.out / "ref"
    if {"extract", "extension"} & set(steps) and not reference.exists():
        done = hstap("capture", "--data", args.data, "--limit", str(CONVERSATIONS), "--max-tokens", str(MAX_TOKENS),
                     "--teacher", "hidden", "--out", str(reference))
        say(f"transformers reference capture: exit {done.returncode}")
    for step in steps:
        say(f"== {step}")
        try:
            results[step] = (step_eagle(args.out) if step == "eagle"
                             else step_capture(args.out, args.data, step, reference))
        except Exception as e:  # noqa: BLE001 — a lab run records the failure and goes on to the next step
            traceback.print_exc()
            results[step] = {"error": f"{type(e).__name__}: {e}"[:4000]}
        save()
    if "extract" in results and "extension" in results:
        results["extract_vs_extension"] = compare(args.out / "cap-extract", args.out / "cap-extension")
        save()
    say("ALL DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
