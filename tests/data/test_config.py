"""PromptsConfig: NAME:WEIGHT sources, quotas that always sum to the total, the settings that define a prompt set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hstap.data.config import IDENTITY_FIELDS, PromptsConfig, parse_source


def _cfg(total: int, *sources: str, **extra) -> PromptsConfig:
    return PromptsConfig(out="p.jsonl", total=total, sources=list(sources), **extra)


@pytest.mark.parametrize("item,expected", [("code", ("code", 1.0)), ("magpie:2.5", ("magpie", 2.5)),
                                           ("sharegpt:1e3", ("sharegpt", 1000.0))])
def test_parse_source(item, expected):
    assert parse_source(item) == expected


@pytest.mark.parametrize("item", ["alpaca", "code:", "code:x", "code:-1", "code:inf", "code:nan"])
def test_parse_source_refuses(item):
    with pytest.raises(ValueError):
        parse_source(item)


@pytest.mark.parametrize("total,sources,expected", [
    (9, ("sharegpt", "magpie", "code"), {"sharegpt": 3, "magpie": 3, "code": 3}),
    (10, ("sharegpt", "magpie", "code"), {"sharegpt": 4, "magpie": 3, "code": 3}),  # ties: the first given
    (10, ("magpie:2", "code"), {"magpie": 7, "code": 3}),
    (1, ("code", "magpie:3"), {"code": 0, "magpie": 1}),
    (100_000, ("sharegpt:1", "magpie:0.5", "code:0.25"), {"sharegpt": 57143, "magpie": 28571, "code": 14286}),
])
def test_quotas_sum_to_the_total(total, sources, expected):
    quotas = _cfg(total, *sources).quotas()
    assert quotas == expected and sum(quotas.values()) == total
    assert list(quotas) == [parse_source(s)[0] for s in sources], "sources run in the order given"


def test_validation():
    with pytest.raises(ValidationError, match="given twice"):
        _cfg(3, "code", "code:2")
    with pytest.raises(ValidationError, match="must end in .jsonl"):
        PromptsConfig(out="p.json", total=3)
    with pytest.raises(ValidationError, match="at least one source"):
        _cfg(3)
    with pytest.raises(ValidationError, match="code_min_lines 9 is above code_max_lines 8"):
        _cfg(3, "code", code_min_lines=9, code_max_lines=8)


def test_identity_names_real_fields_and_leaves_out_what_may_change():
    cfg = _cfg(3, "code")
    assert set(IDENTITY_FIELDS) <= set(PromptsConfig.model_fields)
    assert not {"out", "total", "sources", "device", "batch_size", "cuda_graphs"} & set(IDENTITY_FIELDS)
    assert cfg.identity()["filters"]["min_chars"] == 16
    assert cfg.provenance_path().name == "p.jsonl.provenance.json"
