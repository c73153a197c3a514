"""Capture: the engine-agnostic tap (tap.py), canonical layer ids (layers.py), the transformers adapter (hf.py),
the embedded capture run (run.py), and the in-engine adapters (sglang.py, vllm.py) with what they share: spans,
request matching, stitching (engine_session.py).

Nothing is imported here: `hstap --help` reads capture/config.py without loading torch.
"""
