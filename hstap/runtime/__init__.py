"""The decoding runtime shared by synth, the `hf` server and evaluate: a preallocated KV cache whose rows advance
independently, lean forwards of the target (Llama family) and of the EAGLE-3 drafter over it, CUDA graphs of
the one-token step and of each draft shape's cycle, and the batched Engine.

    from hstap.runtime.target import Runtime            # prefill + one-token steps (vanilla decoding)
    from hstap.runtime.spec import SpecDecoder          # chain / tree / n-gram speculative decoding
    from hstap.runtime.engine import Engine, Request    # requests from any thread, decoded in batches

The same code runs eagerly on a CPU (tests) and as captured graphs on CUDA. Nothing is imported here, so
importing a config never loads torch.
"""
