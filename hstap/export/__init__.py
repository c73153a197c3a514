"""Export a trained drafter as a checkpoint SGLang or vLLM loads as an EAGLE-3 draft model.

    from hstap.export.write import export_drafter
    export_drafter("runs/drafter", "vllm", "runs/drafter-vllm")   # -> Path of the written directory

hstap/export/write.py reads and checks the drafter and writes the directory atomically; formats.py holds what
each engine's loader expects.
"""
