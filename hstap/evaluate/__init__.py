"""Speculative decoding with the embedded target against vanilla decoding: the decoding methods on the runtime
(methods.py; the drafts and verification themselves live in hstap.runtime), the results with τ / acceptance /
speedup (results.py), the evaluation run (run.py), greedy divergences (divergence.py), the report (report.py).

Nothing is imported here: `hstap --help` reads evaluate/config.py without loading torch.
"""
