"""`hstap recipe`: the whole job for any target in one command and one YAML file, every stage resumable.

    hstap recipe --config smollm2-gpu --out runs/gpu                 # a shipped recipe, found by name
    hstap recipe --config my-llama.yaml --stages eval,export          # a subset; the others are left as they are
    hstap recipe --config my-llama.yaml --set train.time_budget_s=2h --redo train

prompts → synth (embedded, a running server, or an engine the recipe starts) → train (online where the target fits
beside the drafter, else capture → store → train) → eval → export. config.py reads the YAML (the stage configs as
sections), memory.py decides online or store, state.py records finished stages in OUT/recipe.json, stages.py runs
one stage through its library entry point, run.py runs them in order. Nothing is imported here: `hstap --help`
reads recipe/config.py without loading torch.
"""
