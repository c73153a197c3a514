"""Speculative decoding with the embedded target: chain and EAGLE-2 tree drafts (tree.py, drafting.py), greedy and
sampled verification (spec.py, sampling.py), τ / acceptance / speedup against vanilla decoding (run.py), the
report (report.py).

Nothing is imported here: `hstap --help` reads evaluate/config.py without loading torch.
"""
