"""Regenerate training answers with the target: embedded (batched, CUDA graphs on a GPU) or OpenAI-compatible servers.

    from hstap.synth.config import SynthConfig
    from hstap.synth.run import run_synth
    result = run_synth(SynthConfig(model="smollm2", data="sharegpt", limit=100, out="runs/synth.jsonl"))
    print(result.summary())

It also writes prompts: `hstap prompts` (hstap/synth/prompts.py) mixes ShareGPT, stdlib-code requests and
Magpie prompts the target writes itself (hstap/synth/magpie.py) into a JSONL file synth then answers.
"""
