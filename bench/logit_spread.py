"""How far two computations of the target's logits at the same positions drift apart, in rounding steps of the
dtype: the scale `hstap.evaluate.divergence.WITHIN_ROUNDING_ULPS` calls rounding.

    python bench/logit_spread.py [--dtype fp32 bf16] [--device cpu|cuda] [--prompts 8] [--tokens 48]

For each MT-bench first turn the runtime decodes greedily one token per forward (vanilla decoding's path) and
keeps every step's logits; then each position's logits are computed again by a prefill of the prompt and the
answer so far (many rows per product, other kernels). At every position: the change of the top logit and of the
top-2 gap between the two computations, in rounding steps (`rounding_step`) at the top logit's magnitude.
"""

from __future__ import annotations

import torch

import harness
from hstap.config import torch_dtype
from hstap.data import load_mtbench, render_prompt
from hstap.evaluate.divergence import rounding_step
from hstap.models import load_target
from hstap.runtime.decode import Request, decode
from hstap.runtime.target import Runtime


class Recorder:
    """A stepper over the runtime that keeps a copy of every logits row it returns."""

    def __init__(self, runtime: Runtime):
        self.rt, self.logits = runtime, []

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        out = self.rt.prefill(ids, mask, max_new_tokens)  # (1, V)
        self.logits.append(out[0].clone())
        return out

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.rt.step(tokens)  # (1, V)
        self.logits.append(out[0].clone())
        return out


def spreads(model, prompt: list[int], tokens: int, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(|Δ top logit|, |Δ top-2 gap|) in rounding steps at every position of one greedy answer."""
    rt = Runtime(model, 1, len(prompt) + tokens + 1)
    rec = Recorder(rt)
    answer = decode(rec, [Request(prompt, tokens)], 0, [], model.device)[0].tokens
    out = []
    for i, stepped in enumerate(rec.logits[: len(answer)]):
        ids = torch.tensor([prompt + answer[:i]], device=model.device)
        again = rt.prefill(ids, torch.ones_like(ids), 1)[0]  # (V,) the same position, computed by a prefill
        first, second = stepped.topk(2).indices.tolist()
        unit = rounding_step(float(stepped[first]), dtype)
        gap = (stepped[first] - stepped[second]) - (again[first] - again[second])
        out.append((abs(float(stepped[first] - again[first])) / unit, abs(float(gap)) / unit))
    return out


def main() -> None:
    ap = harness.parser(__doc__, device="cpu")
    ap.add_argument("--dtype", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    run = harness.start(args)
    print("\n| dtype | positions | Δ top logit: median / p90 / max | Δ top-2 gap: median / p90 / max |")
    print("|---|---:|---:|---:|")
    numbers = {}
    for name in args.dtype:
        dtype = torch_dtype(name)
        target = load_target("smollm2", device=args.device, dtype=dtype)
        rows = []
        with torch.inference_mode():
            for q in load_mtbench()[: args.prompts]:
                rows += spreads(target.model, render_prompt(q.messages[:1], target.tokenizer), args.tokens, dtype)
        cells, quantiles = [], {}
        for k, what in enumerate(("top_logit", "top2_gap")):
            values = sorted(r[k] for r in rows)
            quantiles[what] = {q: values[int(f * (len(values) - 1))] for q, f in (("median", 0.5), ("p90", 0.9),
                                                                              ("max", 1.0))}
            cells.append(" / ".join(f"{v:.0f}" for v in quantiles[what].values()))
        numbers[name] = {"positions": len(rows), "rounding_steps": quantiles}
        print(f"| {name} | {len(rows)} | {cells[0]} | {cells[1]} |")
    run.finish(numbers)


if __name__ == "__main__":
    main()
