import pytest

from hstap.capture.layers import default_layers, parse_layers
from hstap.errors import HstapError


def test_auto_matches_eagle3_default():
    assert default_layers(30) == [1, 14, 26]  # SmolLM2
    assert default_layers(61) == [1, 29, 57]  # DeepSeek/Kimi
    assert parse_layers("auto", 30) == [1, 14, 26]


def test_explicit_ids():
    assert parse_layers("1,14,26", 30) == [1, 14, 26]
    assert parse_layers(" 0, 29 ", 30) == [0, 29]


@pytest.mark.parametrize("spec, needle", [
    ("1,30", "out of range"), ("-1,3", "out of range"), ("3,3", "duplicate"), ("14,1", "ascending"),
    ("a,b", "comma-separated"), ("", "empty"),
])
def test_bad_ids_are_clear_errors(spec, needle):
    with pytest.raises(HstapError, match=needle):
        parse_layers(spec, 30)
