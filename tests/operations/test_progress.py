"""The progress line: window averages, percent, ETA."""

from boost_jax.operations.progress import Window, duration


def test_duration():
    assert [duration(s) for s in (0.4, 45, 187, 7500)] == ["0s", "45s", "3m07s", "2h05m"]


def test_the_progress_line_averages_its_window():
    w = Window(total=300, tokens_per_step=2048, flops_per_step=2e12, peak=1e14)
    for dt in (0.5, 0.3):  # one slow step does not decide the throughput
        w.add(dt)
    assert w.line(40, 5.12345) == ("step  40/300  13% | loss 5.1235 | 5,120 tok/s | "
                                   "0.400 s/step | MFU 5.0% | ETA 1m44s")
    w.add(1.0)
    assert "| 2,048 tok/s | 1.000 s/step |" in w.line(41, 5.0)  # a new window
    no_peak = Window(total=10, tokens_per_step=10, flops_per_step=1.0, peak=None)
    no_peak.add(1.0)
    assert "MFU" not in no_peak.line(10, 1.0)
