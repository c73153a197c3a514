"""Is a low τ the drafter's quality or an inference bug? Decode prompts with a chain draft, then run the
training-time test (teacher-forced, the trainer's own code) on the very sequences decoded and compare.

    python bench/drafter_gap.py --drafter runs/gpu-drafter [--bench mt-bench] [--limit 8] [--max-new-tokens 96]

If inference drafting matched training, the first draft's acceptance rate at inference is close to the teacher-
forced step-0 top-1 on the same tokens (a little below it: drafting restarts right after a rejection, a harder
than average position). A large gap would point at an alignment bug; agreement says the drafter is the limit.

It also counts the answer tokens outside the draft vocabulary: each is a certain rejection that the teacher-forced
top-1 (counted on in-vocabulary positions, as training counts it) does not show. `--grow 24000 32000` says how many
would remain outside if the vocabulary were grown to those sizes as `hstap train --init-from D --draft-vocab N`
grows it (hstap.drafter.grow_draft_vocab), with token counts from `--count-from` (default: the assistant turns of
2,000 ShareGPT conversations, a stand-in for the training answers where those are not at hand).

It splits the teacher-forced step-0 top-1 by how sure the target itself was of the token drafted (its top-1
probability there): if the misses sit where the target hesitates, a drafter can only guess the target's pick
from details of its state, and more of the same training moves τ slowly; if they sit where the target is sure,
the drafter is missing something it could learn.
"""

from __future__ import annotations

from pathlib import Path

import torch

import harness
from hstap.data import RenderedSample
from hstap.data.sources import open_source
from hstap.drafter import grow_draft_vocab, target_to_draft_ids
from hstap.drafter.load import load_drafter
from hstap.evaluate.run import load_prompts
from hstap.evaluate.methods import speculative_generate
from hstap.metrics import acceptance_length
from hstap.runtime.shapes import DraftShape
from hstap.models import load_target
from hstap.train.data import OnlineSource
from hstap.train.ttt import collate, shift_left, ttt_forward

CONFIDENCE_BINS = (0.0, 0.3, 0.5, 0.8, 0.95, 1.01)  # the target's top-1 probability at the drafted token


def main() -> None:
    ap = harness.parser(__doc__, device=None)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--bench", default="mt-bench")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--chain", type=int, default=3)
    ap.add_argument("--grow", type=int, nargs="*", default=[], help="draft vocabulary sizes to count misses at")
    ap.add_argument("--count-from", default="sharegpt", help="data source whose assistant turns give the counts")
    ap.add_argument("--count-limit", type=int, default=2000)
    args = ap.parse_args()
    run = harness.start(args)
    target = load_target("smollm2")
    drafter = load_drafter(args.drafter, target)
    stop = set(target.stop_ids)
    samples, first_accepted, verifications, emitted = [], 0, 0, 0
    t2d = target_to_draft_ids(drafter.d2t, drafter.config.vocab_size)
    answers = []
    for p in load_prompts(args.bench, target.tokenizer, args.limit):
        gen = speculative_generate(target.model, drafter, p.ids, DraftShape.parse(f"chain:{args.chain}"),
                                   args.max_new_tokens, stop)
        first_accepted += sum(a >= 1 for a in gen.accepted)
        verifications += len(gen.accepted)
        emitted += sum(gen.emitted)
        answers.append(torch.tensor(gen.tokens, dtype=torch.long))
        samples.append(RenderedSample(p.id, p.ids + gen.tokens, [False] * len(p.ids) + [True] * len(gen.tokens)))
    source = OnlineSource(target, samples, drafter.config.aux_layer_ids, dtype="fp32")
    with torch.no_grad():
        batch = collate(source.fetch(list(range(len(samples)))), drafter.config.aux_layer_ids)
        out = ttt_forward(drafter, batch, t2d, args.chain)
    print(f"{len(samples)} prompts, {verifications} verifications")
    print(f"inference: first draft accepted in {first_accepted / verifications:.3f} of verifications, "
          f"τ {acceptance_length(emitted, verifications):.2f} (chain {args.chain})")
    every = torch.cat(answers)  # the answers' tokens, all prompts
    outside = t2d[every] < 0
    print(f"answer tokens outside the {drafter.d2t.numel():,}-token draft vocabulary: {int(outside.sum())} of "
          f"{every.numel()} ({100 * float(outside.float().mean()):.2f} %)")
    step_top1 = [c / n for c, n in zip(out.step_correct, out.step_counted)]
    print("teacher-forced on the decoded sequences, top-1 per TTT step: " + ", ".join(f"{t:.3f}" for t in step_top1))
    bins = confidence_breakdown(out, batch)
    print("step-0 top-1 by the target's own top-1 probability at the drafted token:")
    for b in bins:
        print(f"  p in [{b['low']:.2f}, {min(b['high'], 1.0):.2f}): {b['share']:6.1%} of positions, top-1 "
              f"{b['top1']:.3f}, {b['share_of_misses']:6.1%} of all misses")
    grown = {}
    if args.grow:
        counts = assistant_counts(target.tokenizer, args.count_from, args.count_limit, drafter.config.vocab_size)
        for size in args.grow:
            left = ~grow_draft_vocab(counts, drafter.t2d.cpu(), size)[1][every]
            grown[size] = int(left.sum())
            print(f"grown to {size:,} (counts: assistant turns of {args.count_limit} {args.count_from} conversations): "
                  f"{int(left.sum())} outside ({100 * float(left.float().mean()):.2f} %)")
    run.finish({"prompts": len(samples), "verifications": verifications,
                "first_draft_accepted": first_accepted / verifications,
                "tau": acceptance_length(emitted, verifications), "answer_tokens": every.numel(),
                "outside_draft_vocab": int(outside.sum()), "teacher_forced_top1_per_step": step_top1,
                "step0_by_confidence": bins, "outside_if_grown": grown})


def confidence_breakdown(out, batch) -> list[dict]:
    """Step-0 top-1 agreement with the target's argmax, split by the target's own top-1 probability there. The
    agreement is `ttt_forward`'s own (its run lengths: ≥ 1 where step 0 agreed, countable where ≥ 1 was
    countable), so the counting — answer tokens whose argmax is in the draft vocabulary — is the trainer's."""
    counted, hit = out.run_valid >= 1, out.run_lengths >= 1  # (B, S)
    sure = shift_left(batch.topk_logprobs[..., 0].float().exp(), 1, 0.0)  # (B, S) the target's top-1 prob at t+1
    total, misses = int(counted.sum()), int((counted & ~hit).sum())
    bins = []
    for lo, hi in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:]):
        band = counted & (sure >= lo) & (sure < hi)
        n = int(band.sum())
        if n:
            bins.append({"low": lo, "high": hi, "share": n / total, "top1": int((hit & band).sum()) / n,
                         "share_of_misses": int((band & ~hit).sum()) / max(1, misses)})
    return bins


def assistant_counts(tokenizer, spec: str, limit: int, vocab_size: int) -> torch.Tensor:
    """Target-token counts over the assistant turns of `limit` conversations of `spec`."""
    ids = [torch.tensor(tokenizer(m["content"], add_special_tokens=False)["input_ids"], dtype=torch.long)
           for conv in open_source(spec, limit) for m in conv.messages if m["role"] == "assistant"]
    return torch.bincount(torch.cat(ids), minlength=vocab_size)[:vocab_size]


if __name__ == "__main__":
    main()
