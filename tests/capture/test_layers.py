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


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(ids=st.lists(st.integers(-3, 70), max_size=5), num_layers=st.integers(5, 64))
def test_any_layer_ids_are_canonical_or_one_line(ids, num_layers):
    """Out of range, duplicate, unsorted, empty: refused in one line naming --layers; otherwise returned as given."""
    spec = ",".join(map(str, ids))
    valid = bool(ids) and all(0 <= k < num_layers for k in ids) and all(a < b for a, b in zip(ids, ids[1:]))
    try:
        got = parse_layers(spec, num_layers)
    except HstapError as exc:
        assert not valid and str(exc).startswith("--layers") and "\n" not in str(exc)
    else:
        assert valid and got == ids
