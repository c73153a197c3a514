"""Capture: the engine-agnostic tap, canonical layer ids, and the transformers adapter."""

from hstap.capture.layers import default_layers, parse_layers, to_hf_hidden_states_index
from hstap.capture.tap import Batch, Tap, TapReport, TeacherSpec

__all__ = ["Batch", "Tap", "TapReport", "TeacherSpec", "default_layers", "parse_layers", "to_hf_hidden_states_index"]
