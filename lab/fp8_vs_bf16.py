"""fp8 store vs bf16 store (issue 15): the same conversations captured both ways, a drafter trained from each with
the same seed and steps, and the τ of both — held-out estimate always, MT-bench chain-3 with `--eval`.

    python lab/fp8_vs_bf16.py --data jsonl:runs/demo/synth.jsonl --out runs/fp8cmp            # CPU, tiny sizes
    python lab/fp8_vs_bf16.py --data jsonl:synth.jsonl --out runs/fp8cmp --device cuda --eval  # the GPU recipe

Sizes come from `--preset` (cpu: the `make demo` sizes; gpu: the SmolLM2 recipe of docs/benchmarks.md, TTT 7, a
16k draft vocabulary, 32k-token batches), any of them overridable. Every stage resumes: a capture continues its
store, a finished stage's result is kept in OUT/results.json and skipped on a re-run (so a long GPU comparison can
be run a stage at a time: `--stages capture`, then `train`, then `eval`). The verdict is issue 15's: the two
drafters' τ within 0.05 of each other, held-out estimate and MT-bench chain-3. Prints one table and writes it with
every figure (bytes per token, `hstap compare` of the two stores, steps, tokens/s) to OUT/results.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

PRESETS = {  # the demo's cpu sizes and the GPU recipe's (docs/benchmarks.md, "drafter quality")
    "cpu": dict(max_tokens=320, epochs=4, ttt_steps=4, draft_vocab=4096, lr=3e-3, batch_tokens=2048,
                heldout=0.15, eval_limit=8, eval_tokens=64),
    "gpu": dict(max_tokens=2048, epochs=4, ttt_steps=7, draft_vocab=16384, lr=2e-3, batch_tokens=32768,
                heldout=0.05, eval_limit=80, eval_tokens=256),
}
DTYPES = ("bf16", "fp8")
CHAIN = 3
GOAL = 0.05  # issue 15: the two drafters within 0.05 τ


def capture(args, dtype: str) -> dict:
    from hstap.capture.config import CaptureConfig
    from hstap.capture.run import run_capture
    from hstap.store import store_info

    out = args.out / f"store-{dtype}"
    start = time.perf_counter()
    run_capture(CaptureConfig(model=args.model, data=args.data, limit=args.limit, out=out, dtype=dtype,
                              max_tokens=args.max_tokens, device=args.device, batch_tokens=args.capture_batch_tokens),
                progress=False)
    info = store_info(out)
    return {"seconds": time.perf_counter() - start, "samples": info["samples"], "tokens": info["tokens"],
            "hidden_size": info["hidden_size"],
            "bytes_per_token": info["bytes_per_token"], "teacher_bytes_per_token": info["teacher_bytes_per_token"],
            "bytes_on_disk": info["bytes_on_disk"]}


def train(args, dtype: str) -> dict:
    from hstap.train.config import TrainConfig
    from hstap.train.run import run_train

    cfg = TrainConfig(model=args.model, store=args.out / f"store-{dtype}", out=args.out / f"drafter-{dtype}",
                      seed=args.seed, epochs=args.epochs, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab,
                      lr=args.lr, batch_tokens=args.batch_tokens, heldout=args.heldout, device=args.device,
                      calib_prompts=0, checkpoint_every=10**6)
    r = run_train(cfg, progress=False)
    tau = {int(d): v for d, v in r.heldout.get("tau_est", {}).items()}
    return {"steps": r.steps, "tokens": r.train_tokens, "seconds": r.seconds, "heldout_loss": r.heldout.get("loss"),
            "heldout_top1": r.heldout.get("acc", [None])[0], "tau_est": tau,
            "tau_est_chain": tau.get(min(CHAIN, args.ttt_steps))}


def evaluate(args, dtype: str) -> dict:
    from hstap.evaluate.config import EvalConfig
    from hstap.evaluate.run import run_eval

    cfg = EvalConfig(model=args.model, drafter=args.out / f"drafter-{dtype}", bench="mt-bench", limit=args.eval_limit,
                     chain=[CHAIN], max_new_tokens=args.eval_tokens, device=args.device)
    r = run_eval(cfg, progress=False)
    m = r.methods[0]
    return {"prompts": len(r.prompts), "tau": m.tau, "speedup": r.speedup(m), "seconds": r.vanilla.seconds + m.seconds}


def compare(args) -> dict:
    from hstap.store.compare import compare_stores

    c = compare_stores(args.out / "store-fp8", args.out / "store-bf16")
    return {"ok": c.ok, "verdict": c.verdict(),
            "tensors": {n: {"max_rel": s.max_rel, "min_cos": s.min_cos} for n, s in c.tensors.items()}}


def _f(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def table(res: dict, hidden_size: int) -> str:
    rows = [("bytes/token (measured)", lambda d: f"{res[d]['capture']['bytes_per_token']:.0f} "
                                                 f"({res[d]['capture']['bytes_per_token'] / hidden_size:.2f}·H)"),
            ("steps, train tokens", lambda d: f"{res[d]['train']['steps']}, {res[d]['train']['tokens']}"),
            ("held-out loss", lambda d: _f(res[d]["train"]["heldout_loss"], ".4f")),
            ("held-out top-1 (step 0)", lambda d: _f(res[d]["train"]["heldout_top1"], ".4f")),
            (f"held-out est. τ chain {CHAIN}", lambda d: _f(res[d]["train"]["tau_est_chain"], ".3f"))]
    if all("eval" in res[d] for d in DTYPES):
        rows.append((f"MT-bench τ chain {CHAIN}", lambda d: f"{res[d]['eval']['tau']:.3f} "
                                                           f"({res[d]['eval']['prompts']} prompts)"))
    lines = [f"| {'':<26} | {'bf16 store':>22} | {'fp8 store':>22} |", f"|{'-' * 28}|{'-' * 23}:|{'-' * 23}:|"]
    lines += [f"| {name:<26} | {fmt('bf16'):>22} | {fmt('fp8'):>22} |" for name, fmt in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the conversations, e.g. jsonl:synth.jsonl (hstap synth's output)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=list(PRESETS), default=None, help="default: gpu on CUDA, else cpu")
    ap.add_argument("--limit", type=int, default=None, help="first N conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capture-batch-tokens", type=int, default=None, help="default: 4096 (CPU), 65536 (CUDA)")
    for name in PRESETS["cpu"]:
        kind = float if name in ("lr", "heldout") else int
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help="overrides the preset")
    ap.add_argument("--eval", action="store_true", help=f"also MT-bench chain-{CHAIN} τ of both drafters")
    ap.add_argument("--stages", default="capture,train,eval", help="comma-separated subset, in this order")
    args = ap.parse_args()
    on_gpu = args.device.startswith("cuda")
    for name, value in PRESETS[args.preset or ("gpu" if on_gpu else "cpu")].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.capture_batch_tokens = args.capture_batch_tokens or (65536 if on_gpu else 4096)
    stages = [s for s in ("capture", "train", "eval") if s in args.stages.split(",") and (s != "eval" or args.eval)]
    args.out.mkdir(parents=True, exist_ok=True)
    file = args.out / "results.json"
    res = json.loads(file.read_text()) if file.exists() else {d: {} for d in DTYPES}
    run = {"capture": capture, "train": train, "eval": evaluate}
    for stage in stages:
        for dtype in DTYPES:
            if stage not in res[dtype]:
                print(f"fp8_vs_bf16: {stage} {dtype} ...", flush=True)
                res[dtype][stage] = run[stage](args, dtype)
                file.write_text(json.dumps(res, indent=1))
        if stage == "capture" and "compare" not in res:
            res["compare"] = compare(args)
            file.write_text(json.dumps(res, indent=1))
    res["run"] = {"date": datetime.date.today().isoformat(), "host": platform.processor() or platform.machine(),
                  "device": torch.cuda.get_device_name() if on_gpu else f"CPU, {torch.get_num_threads()} threads",
                  "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}}
    file.write_text(json.dumps(res, indent=1))
    if "compare" in res:
        print(f"hstap compare store-fp8 store-bf16: {res['compare']['verdict']}")
    if all("train" in res[d] for d in DTYPES):
        print(table(res, hidden_size=res["bf16"]["capture"]["hidden_size"]))
        deltas = {}
        if all(res[d]["train"]["tau_est_chain"] is not None for d in DTYPES):
            deltas["held-out est."] = res["fp8"]["train"]["tau_est_chain"] - res["bf16"]["train"]["tau_est_chain"]
        if all("eval" in res[d] for d in DTYPES):
            deltas["MT-bench"] = res["fp8"]["eval"]["tau"] - res["bf16"]["eval"]["tau"]
        for name, delta in deltas.items():
            print(f"{name} τ, fp8 − bf16: {delta:+.3f} ({'within' if abs(delta) <= GOAL else 'NOT within'} {GOAL})")
    print(f"results: {file}")


if __name__ == "__main__":
    main()
