"""Shared fixtures: the real SmolLM2 (loaded once per session) and its tokenizer.

Converted weights are cached under $HSTAP_CACHE (default ~/.cache/hstap), so only the first session pays the
~30 s GGUF conversion.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def target():
    from hstap.models import load_target

    torch.manual_seed(0)
    return load_target("smollm2")


@pytest.fixture(scope="session")
def tokenizer():
    from hstap.models import load_tokenizer

    return load_tokenizer("smollm2")


@pytest.fixture(scope="session")
def train_store(tmp_path_factory):
    """A real capture of a few hundred ShareGPT conversations (short ones), shared by the training tests."""
    from hstap.capture.config import CaptureConfig
    from hstap.capture.run import run_capture

    out = tmp_path_factory.mktemp("train_store") / "store"
    result = run_capture(CaptureConfig(out=out, limit=240, max_tokens=128, batch_tokens=4096), progress=False)
    assert result.tap_report.errors == 0 and result.captured == 240
    return out
