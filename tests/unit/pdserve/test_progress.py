"""Progress: log lines every tenth of the work or every few seconds off a terminal, a tqdm
bar on one; a step that cannot be counted says it is still going."""

from __future__ import annotations

import io
import logging
import re
import time

from pdserve import progress
from pdserve.progress import Progress, still_working, track

logger = logging.getLogger("test.progress")


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger.name]


def test_off_a_terminal_a_line_per_tenth(caplog):
    caplog.set_level(logging.INFO)
    stream = io.StringIO()
    with Progress("converting x.gguf", 30, "tensors", logger, stream, FakeClock()) as p:
        for _ in range(30):
            p.update()
    lines = messages(caplog)
    assert [line.split(": ", 1)[1].split("%")[0] for line in lines] == [
        str(10 * i) for i in range(1, 11)
    ]
    assert lines[-1].startswith("converting x.gguf: 100% (30/30 tensors, 0.0 s)")
    assert stream.getvalue() == ""  # no bar


def test_off_a_terminal_a_line_every_few_seconds_of_slow_work(caplog):
    caplog.set_level(logging.INFO)
    clock = FakeClock()
    p = Progress("loading", 1000, "tensors", logger, io.StringIO(), clock)
    p.update(1)  # 0.1%: nothing to say yet
    assert messages(caplog) == []
    clock.now_s = progress.LOG_EVERY_S
    p.update(1)
    assert messages(caplog) == ["loading: 0% (2/1000 tensors, 5.0 s)"]
    p.update(500)  # several tenths at once: one line, the next at 60%
    p.update(50)
    assert messages(caplog)[1:] == ["loading: 50% (502/1000 tensors, 5.0 s)"]


def test_track_counts_each_item_once_consumed(caplog):
    caplog.set_level(logging.INFO)
    assert list(track(range(5), "work", 5, "items", logger, io.StringIO())) == [0, 1, 2, 3, 4]
    assert messages(caplog)[-1].startswith("work: 100% (5/5 items")


def test_on_a_terminal_a_bar_and_no_log_lines(caplog):
    caplog.set_level(logging.INFO)
    terminal = FakeTerminal()
    assert list(track(range(4), "loading", 4, "tensors", logger, terminal)) == [0, 1, 2, 3]
    assert "loading" in terminal.getvalue() and "tensors" in terminal.getvalue()
    assert messages(caplog) == []


def test_still_working_reports_until_the_step_ends(caplog):
    caplog.set_level(logging.INFO)
    with still_working("writing the tokenizer", logger, io.StringIO(), interval_s=0.01):
        deadline = time.monotonic() + 10
        while len(messages(caplog)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    said = messages(caplog)
    assert len(said) >= 2
    assert all(re.fullmatch(r"writing the tokenizer: still going \(\d+ s\)", m) for m in said)
    time.sleep(0.05)
    assert messages(caplog) == said  # nothing after the step ended


def test_still_working_on_a_terminal_shows_the_time_on_a_bar(caplog):
    caplog.set_level(logging.INFO)
    terminal = FakeTerminal()
    with still_working("writing the tokenizer", logger, terminal, interval_s=0.01):
        deadline = time.monotonic() + 10
        while terminal.getvalue().count("writing the tokenizer: 00:0") < 2:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
    # drawn when created, then redrawn by the reporting thread
    assert terminal.getvalue().count("writing the tokenizer: 00:0") >= 2
    assert messages(caplog) == []
