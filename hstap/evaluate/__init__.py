"""Speculative decoding with the embedded target: chain and EAGLE-2 tree drafts, greedy and sampled verification,
τ / acceptance / speedup against vanilla decoding, and the report."""

from hstap.evaluate.run import EvalConfig, EvalResult, evaluate_shapes, load_prompts, run_eval
from hstap.evaluate.spec import Generation, speculative_generate, vanilla_generate
from hstap.evaluate.tree import SHAPES, DraftShape, DraftTree

__all__ = ["SHAPES", "DraftShape", "DraftTree", "EvalConfig", "EvalResult", "Generation", "evaluate_shapes",
           "load_prompts", "run_eval", "speculative_generate", "vanilla_generate"]
