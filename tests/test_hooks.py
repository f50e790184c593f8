"""The training loop's hooks, each alone: the metrics window, the progress bar, the signal stop.

(``MetricsFile`` is tested in test_epath.py, the stop agreement of ``GlobalBatches`` in
test_prefetch.py and test_distributed.py, the divergence guard in test_divergence.py.)
"""

import math
import os
import signal
import sys

import jax.numpy as jnp
import pytest

from elmo_jax._util.signals import Terminated
from elmo_jax.training.hooks import MetricsWindow, Progress, SignalStop, summarise


def _metrics(fwd: float, bwd: float, count: float = 4.0, grad_norm: float = 1.0) -> dict:
    return {
        "loss_sum_fwd": jnp.float32(fwd * count),
        "loss_sum_bwd": jnp.float32(bwd * count),
        "count": jnp.float32(count),
        "grad_norm": jnp.float32(grad_norm),
    }


def test_the_window_reads_each_step_one_step_late_and_averages_over_tokens():
    w = MetricsWindow(tokens_per_step=80)
    w.add(_metrics(2.0, 4.0, grad_norm=1.0))
    assert w.n == 0 and w.pending is not None  # the first step is waited for, but read with the next
    w.add(_metrics(4.0, 6.0, grad_norm=3.0))
    assert w.n == 1  # the step before the one just dispatched
    record = w.close(step=2, epoch=0)
    assert w.n == 0 and w.pending is None
    assert record["loss_fwd"] == pytest.approx(3.0) and record["loss_bwd"] == pytest.approx(5.0)
    assert record["loss"] == pytest.approx(4.0) and record["perplexity"] == pytest.approx(math.exp(4.0))
    assert record["grad_norm"] == pytest.approx(2.0)
    assert record["step"] == 2 and "startup_s" in record and record["tokens_per_s"] > 0
    assert w.last is record
    w.restart_clock()
    w.add(_metrics(1.0, 1.0))
    second = w.close(step=3, epoch=1)
    assert "startup_s" not in second and second["loss"] == pytest.approx(1.0) and second["epoch"] == 1


def test_summarise_weights_by_token_count_and_caps_the_perplexity():
    sums = {"loss_sum_fwd": 10.0, "loss_sum_bwd": 30.0, "count": 10.0, "grad_norm": 4.0}
    r = summarise(sums, 2, step=7, epoch=0, tokens=100, seconds=2.0)
    assert r["loss"] == pytest.approx(2.0) and r["grad_norm"] == pytest.approx(2.0)
    assert r["tokens_per_s"] == pytest.approx(50.0)
    huge = summarise({**sums, "loss_sum_fwd": 1e6}, 2, step=7, epoch=0, tokens=1, seconds=1.0)
    assert huge["perplexity"] == pytest.approx(math.exp(50.0))  # a finite number to log, not inf


@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_becomes_a_request_and_a_second_one_interrupts_as_itself(second):
    """The second is raised as the command line raises it, so that ``elmo-jax train`` says which
    one stopped it and exits 128 + its number (before, a second SIGTERM or SIGHUP was Ctrl-C's
    KeyboardInterrupt: "interrupted" and 130, found by ``tests/probe_signals.py --twice``)."""
    before = signal.getsignal(signal.SIGTERM)
    # As from a terminal: a suite run under nohup inherits SIGHUP ignored, and SignalStop keeps that.
    hup = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with SignalStop() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested
            with pytest.raises(KeyboardInterrupt) as e:
                os.kill(os.getpid(), getattr(signal, second))
    finally:
        signal.signal(signal.SIGHUP, hup)
    assert signal.getsignal(signal.SIGTERM) is before  # restored on exit
    assert getattr(e.value, "signum", signal.SIGINT) == getattr(signal, second)
    assert isinstance(e.value, Terminated) == (second != "SIGINT")


def test_progress_is_silent_when_disabled_and_shows_the_record_otherwise(capsys):
    off = Progress(False, total=5, start=0)
    off.update()
    off.show({"loss": 1.0, "perplexity": 2.7, "tokens_per_s": 10.0})
    off.close()
    assert capsys.readouterr().err == ""
    on = Progress(True, total=5, start=2)
    on.update()
    on.show({"loss": 1.25, "perplexity": 3.5, "tokens_per_s": 10.0})
    on.close()
    err = capsys.readouterr().err
    assert "3/5" in err and "loss=1.250" in err


@pytest.mark.parametrize("start", [0, 40])
def test_the_bar_s_rate_and_time_left_leave_out_the_first_step_s_compile(capsys, monkeypatch, start):
    """A run's first step waits for its batch and compiles: 100 s here, on a clock the test
    drives, then a step a second. The bar's rate is then 1 step/s, and the time left is one second
    a step, from the first redraws on; a resumed run's bar alike. Negative control, counting the
    first step's seconds: 0.54 step/s after those 10 steps, and 165 s left where 89 are."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)  # tqdm's redraws, not one a minute
    now = [0.0]
    progress = Progress(True, total=start + 100, start=start)
    progress.bar._time = lambda: now[0]
    progress.bar.last_print_t = progress.bar.start_t = 0.0
    now[0] = 100.0  # the batch and the compile
    progress.update()
    for _ in range(10):
        now[0] += 1.0
        progress.update()
    shown = progress.bar.format_dict
    progress.close()
    assert shown["rate"] == pytest.approx(1.0, rel=0.15)
    assert (shown["total"] - shown["n"]) / shown["rate"] == pytest.approx(89.0, rel=0.15)


def test_progress_into_a_log_file_redraws_once_a_minute(capsys, monkeypatch):
    """Every redraw of a bar stays in a log file; on a terminal it overwrites the last. Into a
    file it redraws once a minute, the records' loss and rate included, not at each record."""
    into_a_file = Progress(True, total=500, start=0)
    assert into_a_file.bar.mininterval == 60.0
    capsys.readouterr()
    for step in range(1, 501):  # a record every 10 steps, as the README's run logs
        into_a_file.update()
        if step % 10 == 0:
            into_a_file.show({"loss": 5.0, "perplexity": 148.4, "tokens_per_s": 4000.0})
    assert capsys.readouterr().err == ""  # none in 500 quick steps; each record forced one before (50)
    into_a_file.close()
    assert capsys.readouterr().err.count("500/500") == 1
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    on_a_terminal = Progress(True, total=5, start=0)
    assert on_a_terminal.bar.mininterval < 1  # tqdm's own default
    on_a_terminal.close()


def _shown(tty, master: int) -> str:
    """What was written to the terminal ``tty`` since the last look (read from its ``master`` side)."""
    import select

    tty.flush()
    out = b""
    while select.select([master], [], [], 0.2)[0]:  # what was written is there already
        out += os.read(master, 65536)
    return out.decode(errors="replace")


def _drawn(tty, master: int, **width) -> str:
    """What a 3-step tqdm bar on ``tty`` put on the terminal."""
    from tqdm import tqdm

    for _ in tqdm(range(3), file=tty, mininterval=0, **width):
        pass
    return _shown(tty, master)


def test_a_bar_on_a_terminal_that_reports_no_size_is_drawn_80_wide(monkeypatch):
    """A pseudo-terminal opened with no window size (docker exec -t, some CI runners) reports 0 x 0,
    and with tqdm's own size (one less of each) a bar was not drawn there: no progress shown."""
    import fcntl
    import io
    import struct
    import termios

    from elmo_jax._util.terminal import bar_size

    master, slave = os.openpty()  # no window size set: 0 x 0
    try:
        with os.fdopen(slave, "w") as tty:
            assert os.get_terminal_size(slave).columns == 0
            assert bar_size(tty) == {"ncols": 80, "nrows": 20}
            drawn = _drawn(tty, master, **bar_size(tty))
            assert "3/3" in drawn and max(len(line) for line in drawn.replace("\r", "\n").splitlines()) <= 80, drawn
            # Negative control: tqdm's own size of the same terminal draws nothing.
            assert "3/3" not in _drawn(tty, master, dynamic_ncols=True)
            # Training's bar on that terminal as its stderr, where tqdm measures the terminal
            # itself unless told its size (with ncols alone, a height of -1 hid the bar).
            monkeypatch.setattr(sys, "stderr", tty)
            progress = Progress(True, total=3, start=0)
            for _ in range(3):
                progress.update()
            progress.close()
            monkeypatch.undo()
            assert "3/3" in _shown(tty, master)
            # A terminal with a size, a file or a pipe: the width tqdm reads at each redraw.
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
            assert bar_size(tty) == {"dynamic_ncols": True}
            assert "3/3" in _drawn(tty, master, dynamic_ncols=True)
    finally:
        os.close(master)
    assert bar_size(io.StringIO()) == {"dynamic_ncols": True}
