"""The store's layer tensor names: spelled and parsed back in one place, so capture, store and training agree."""

from __future__ import annotations

import pytest

from hstap.store.names import hidden_layer, hidden_name, scale_layer, scale_name


@pytest.mark.parametrize("layer", [0, 1, 14, 26, 60])
def test_names_round_trip(layer):
    assert hidden_name(layer) == f"hidden.{layer}" and scale_name(layer) == f"hidden_scale.{layer}"
    assert hidden_layer(hidden_name(layer)) == layer and scale_layer(scale_name(layer)) == layer


@pytest.mark.parametrize("name", ["hidden_scale.14", "teacher.hidden", "teacher.topk_ids", "input_ids", "hidden.",
                                  "hidden.x", "hidden.1.5", "hidden.--1", "hidden14", "xhidden.14"])
def test_other_names_are_no_hidden_layer(name):
    assert hidden_layer(name) is None


def test_scales_are_not_hidden_states_and_back():
    assert scale_layer("hidden.14") is None and scale_layer("hidden_scale.x") is None
    assert hidden_layer("hidden.-1") == -1 == scale_layer("hidden_scale.-1")  # as the reader has always read them
