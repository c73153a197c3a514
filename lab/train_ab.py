"""A/B of one training choice: two (or, with --c, three) `hstap train` runs on the same store, with the same seed,
batches and steps, that differ only by the settings given for each arm (any TrainConfig field, `store` too: an arm may train on another
capture of the same conversations); then their held-out figures at every epoch side by side and, with
--mtbench N, τ on N MT-bench first turns replayed on the target's greedy answers (hstap.train.replay, fp32) for
n-gram 3, chain 3 and hybrid 4,2. Seeds given together run one after another.

    python lab/train_ab.py --store runs/store --out runs/ab --a loss_on=answers --b loss_on=all \
        --epochs 4 --ttt-steps 3 --draft-vocab 8192 --seeds 0 1 --mtbench 80 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from hstap.train.config import TrainConfig
from hstap.train.run import run_train


def parse_settings(pairs: list[str]) -> dict[str, str]:
    """["loss_on=all", ...] → {"loss_on": "all"}; TrainConfig validates the values."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in TrainConfig.model_fields:
            raise SystemExit(f"--a/--b {pair!r}: expected FIELD=VALUE with FIELD one of TrainConfig's fields")
        out[name] = value
    return out


def train_arm(args: argparse.Namespace, name: str, settings: dict, seed: int) -> Path:
    out = args.out / f"{name}_s{seed}"
    start = time.perf_counter()
    base = dict(store=args.store, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab, seed=seed, calib_prompts=0,
                device=args.device)
    cfg = TrainConfig(**{**base, **settings}, out=out, overwrite=True)  # an arm's settings override the flags
    result = run_train(cfg, progress=False)
    print(f"arm {name} {settings} seed {seed}: {result.summary()} ({time.perf_counter() - start:.0f} s)", flush=True)
    return out


def evals(run: Path) -> list[dict]:
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r["kind"] == "eval"]


def heldout_table(a: Path, b: Path, chain: int, name: str = "B") -> None:
    """Arm A against arm `name` at every evaluation (each on its own store's held-out split)."""
    tau = lambda r: r.get("tau_est", {}).get(str(chain), float("nan"))
    print(f"\n| epoch | step | loss A | loss {name} | step-0 top-1 A | step-0 top-1 {name} | est. τ chain {chain} A "
          f"| est. τ chain {chain} {name} |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for x, y in zip(evals(a), evals(b)):
        print(f"| {x['epoch']} | {x['step']} | {x['loss']:.3f} | {y['loss']:.3f} | {x['acc'][0]:.3f} "
              f"| {y['acc'][0]:.3f} | {tau(x):.2f} | {tau(y):.2f} |")


def mtbench_table(runs: dict[str, Path], limit: int, max_new_tokens: int) -> None:
    from hstap.drafter.load import load_drafter
    from hstap.evaluate.run import load_prompts
    from hstap.models import load_target
    from hstap.runtime.shapes import DraftShape
    from hstap.train.replay import chain_runs, greedy_answers, replay

    target = load_target("smollm2")
    answers = greedy_answers(target, load_prompts("mt-bench", target.tokenizer, limit), max_new_tokens)
    shapes = [DraftShape.parse(s) for s in ("ngram:3", "chain:3", "hybrid:4,2")]
    print(f"\nMT-bench, {len(answers)} first turns, greedy, {max_new_tokens} new tokens, replayed (fp32)")
    print("\n| run | " + " | ".join(s.spec for s in shapes) + " |")
    print("|---|" + "---:|" * len(shapes))
    for name, run in runs.items():
        chains = chain_runs(target, load_drafter(run, target), answers, max(s.depth for s in shapes))
        taus = [replay(answers, chains, s, max_new_tokens) for s in shapes]
        print(f"| {name} | " + " | ".join(f"{t / n:.2f}" for t, n in taus) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True,
                    help="a capture store (hstap capture), unless an arm sets its own")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--a", nargs="*", default=[], metavar="FIELD=VALUE", help="arm A's TrainConfig settings")
    ap.add_argument("--b", nargs="+", required=True, metavar="FIELD=VALUE", help="arm B's TrainConfig settings")
    ap.add_argument("--c", nargs="+", default=None, metavar="FIELD=VALUE",
                    help="a third arm's settings (A is trained once for both comparisons)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mtbench", type=int, default=0, help="replay τ on this many MT-bench first turns (0: off)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    arms = {"A": parse_settings(args.a), "B": parse_settings(args.b)}
    if args.c:
        arms["C"] = parse_settings(args.c)
    print(f"date {datetime.date.today()}, {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, store {args.store}, {args.epochs} epochs, lr {args.lr}, "
          f"{args.batch_tokens} tokens a batch, TTT {args.ttt_steps}, draft vocab {args.draft_vocab}; "
          f"A {arms['A'] or 'defaults'}, " + ", ".join(f"{k} {v}" for k, v in arms.items() if k != "A"), flush=True)
    runs = {}
    for seed in args.seeds:
        for name, settings in arms.items():
            runs[f"{name} seed {seed}"] = train_arm(args, name, settings, seed)
        for other in [k for k in arms if k != "A"]:
            heldout_table(runs[f"A seed {seed}"], runs[f"{other} seed {seed}"], min(3, args.ttt_steps), other)
    if args.mtbench:
        mtbench_table(runs, args.mtbench, args.max_new_tokens)


if __name__ == "__main__":
    main()
