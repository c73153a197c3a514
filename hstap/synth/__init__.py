"""Regenerate training answers with the target: embedded (batched, CUDA graphs on a GPU) or OpenAI-compatible servers.

    from hstap.synth.config import SynthConfig
    from hstap.synth.run import run_synth
    result = run_synth(SynthConfig(model="smollm2", data="sharegpt", limit=100, out="runs/synth.jsonl"))
    print(result.summary())
"""
