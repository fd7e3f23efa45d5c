"""studies.fp8_sm90.clock_sampling: nvidia-smi's lines parsed and assigned to the phase they fall in."""

import time

from studies.fp8_sm90.clock_sampling import Phase, parse_samples, phase_means, table


def _stamp(t):
    whole = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(int(t)))
    return f"{whole}.{int(round((t - int(t)) * 1000)):03d}"


def test_samples_fall_into_their_phase_after_it_settles():
    t0 = float(int(time.time()))
    lines = [f"{_stamp(t0 + 0.1 * i)}, {1980 - 10 * i}, {600 + i}" for i in range(40)]
    lines.insert(3, "[Not Supported], 1980, 600")  # a line that does not parse is skipped
    samples = parse_samples("\n".join(lines))
    assert len(samples) == 40 and abs(samples[5].t - (t0 + 0.5)) < 1e-6
    first, second = Phase("a", t0, t0 + 2.0, 10, 1.0), Phase("b", t0 + 2.0, t0 + 4.0, 10, 2.0)
    m = phase_means(first, samples)
    # samples 5..20 (t0 + 0.5 .. t0 + 2.0): the first quarter of the phase dropped
    assert m["samples"] == 16
    assert abs(m["sm_mhz"] - (1980 - 10 * 12.5)) < 1e-9 and abs(m["power_w"] - 612.5) < 1e-9
    assert phase_means(Phase("c", t0 + 10, t0 + 11, 1, 1.0), samples)["samples"] == 0
    text = table([first, second, first], samples)
    assert "| a | 1.0000 |" in text and "| b | 2.0000 |" in text
