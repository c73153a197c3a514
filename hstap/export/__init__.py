"""Export a trained drafter as a checkpoint SGLang or vLLM loads as an EAGLE-3 draft model.

    from hstap.export.write import export_drafter
    export_drafter("runs/drafter", "vllm", "runs/drafter-vllm")   # -> Path of the written directory

hstap/export/write.py writes the directory atomically; check.py reads and checks the drafter, and re-loads an
export as the engines read it (`hstap export --check`); formats.py holds what each engine's loader expects.
"""
