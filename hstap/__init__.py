"""hstap — hidden-state tap: capture a served LLM's residual stream and train EAGLE-3 drafters on it.

Stages, one package each: data → synth → capture → store → train → evaluate → export; serve supervises engines.
"""

__version__ = "0.1.0"
