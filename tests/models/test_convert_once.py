"""Processes started together (torchrun ranks, test workers) convert the embedded GGUF once, not once each."""

from __future__ import annotations

import threading
import time

from hstap.models import target as target_module


def test_concurrent_first_uses_convert_once(tmp_path, monkeypatch):
    calls, inside = [], []

    def fake_convert(name, dest):  # the real one takes ~30 s; this one only has to be slow enough to overlap
        assert not inside, "two conversions ran at once"
        inside.append(name)
        calls.append(name)
        time.sleep(0.2)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        inside.clear()

    monkeypatch.setattr(target_module, "_convert_gguf", fake_convert)
    dest = tmp_path / "models" / "smollm2"
    start = threading.Barrier(4)
    errors = []

    def first_use():
        start.wait()
        try:
            target_module._convert_once("smollm2", dest)
        except AssertionError as e:  # surfaced below: a thread's assertion does not fail the test by itself
            errors.append(e)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and calls == ["smollm2"]
    assert (dest / "config.json").exists()
