"""Capture: the engine-agnostic tap (tap.py), canonical layer ids (layers.py), the transformers adapter (hf.py),
the embedded capture run (run.py), and the in-engine adapters (engine.py, sglang.py, vllm.py).

Nothing is imported here: `hstap --help` reads capture/config.py without loading torch.
"""
