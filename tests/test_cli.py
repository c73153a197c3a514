"""The CLI's last line when a command is stopped: it names what stopped it."""

from __future__ import annotations

import pytest

import hstap.synth.cli
from hstap.cli import main
from hstap.errors import Interrupted


@pytest.mark.parametrize("raised, line, rc", [
    (KeyboardInterrupt(), "hstap: interrupted (SIGINT)", 130),  # timeout -s INT printed "hstap: " on 2026-12-03
    (Interrupted(15, "stopped by SIGTERM; 12 answers kept"), "hstap: stopped by SIGTERM; 12 answers kept", 143),
])
def test_a_stopped_command_says_what_stopped_it(monkeypatch, capsys, raised, line, rc):
    def stopped(cfg):
        raise raised

    monkeypatch.setattr(hstap.synth.cli, "run", stopped)
    assert main(["synth", "--model", "smollm2", "--data", "sharegpt", "--out", "answers.jsonl"]) == rc
    assert capsys.readouterr().err.strip().splitlines()[-1] == line
