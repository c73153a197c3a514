"""Progress fit for a log (hstap.progress): a bar on a terminal, plain lines every few seconds anywhere else."""

from __future__ import annotations

import io

from tqdm import tqdm

from hstap.capture.run import prefill_with_tap
from hstap.config import TeacherSpec
from hstap.data import RenderedSample
from hstap.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_every_few_seconds_and_a_last_one():
    """An injected clock, one update a second: a line at 10 s and 20 s, the last at close (with the postfix),
    none rewritten; a second close writes nothing more."""
    now = [0.0]
    log = io.StringIO()
    bar = progress_bar(total=100, desc="train", unit="step", stream=log, clock=lambda: now[0], every_s=10)
    assert isinstance(bar, LineProgress)
    for second in range(1, 26):
        now[0] = float(second)
        bar.update(4)
        if second == 21:
            bar.set_postfix(loss="1.234")
    bar.close()
    bar.close()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    assert text.splitlines() == ["train: 40/100 step (40%), 00:10 elapsed, 4.00 step/s",
                                 "train: 80/100 step (80%), 00:20 elapsed, 4.00 step/s",
                                 "train: 100/100 step (100%), 00:25 elapsed, 4.00 step/s, loss=1.234"]


def test_an_iterated_log_bar_counts_its_items_and_ends_with_them():
    """Wrapping a list (merge, the draft vocabulary): every item yielded, the total taken from the list, scaled
    numbers with unit_scale, and the last line written when the loop ends."""
    log = io.StringIO()
    items = list(range(2500))
    assert list(progress_bar(items, desc="merge", unit="shard", unit_scale=True, stream=log, clock=lambda: 0.0)) \
        == items
    assert log.getvalue() == "merge: 2.50k/2.50k shard (100%), 00:00 elapsed, 0.00 shard/s\n"


def test_a_terminal_keeps_its_redrawn_bar_and_disabled_stays_silent():
    screen = Terminal()
    bar = progress_bar(total=3, desc="eval", unit="prompt", stream=screen)
    assert isinstance(bar, tqdm)
    bar.update(3)
    bar.close()
    assert "\r" in screen.getvalue()  # tqdm's redraw, as on a terminal
    quiet = io.StringIO()
    silent = progress_bar(total=3, desc="eval", stream=quiet, disable=True)
    silent.update(3)
    silent.close()
    assert quiet.getvalue() == ""


def test_a_capture_logged_to_a_file_writes_lines_not_redraws(target, capsys, monkeypatch):
    """The capture loop with stderr captured (not a terminal) over 24 one-sample batches: tqdm told to redraw at
    every update (TQDM_MININTERVAL=0) would write a carriage return per batch; the log gets whole lines."""
    monkeypatch.setenv("TQDM_MININTERVAL", "0")
    ids = [target.tokenizer(f"Question {i}: what is {i} plus {i}?", add_special_tokens=False)["input_ids"]
           for i in range(24)]
    samples = [RenderedSample(id=f"s{i}", input_ids=x, loss_mask=[True] * len(x)) for i, x in enumerate(ids)]
    stored = []
    prefill_with_tap(target, samples, [1, 14, 26], TeacherSpec(kind="hidden", k=0),
                     lambda sid, tensors: stored.append(sid), dtype="bf16", batch_tokens=max(map(len, ids)),
                     device="cpu", progress=True)
    err = capsys.readouterr().err
    assert len(stored) == 24
    assert err.count("\r") <= 20, err[:500]
    assert err.splitlines()[-1].startswith("capture: ") and "(100%)" in err.splitlines()[-1], err
