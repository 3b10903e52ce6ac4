from tokenmill_runner.progress import Snapshot, ThroughputMeter, eta_seconds, format_duration, render_line


def test_rates_follow_the_window_not_the_whole_run():
    meter = ThroughputMeter(window_s=10)
    meter.record(0.0, 100, 1000)  # a fast start...
    for t in range(20, 30):
        meter.record(float(t), 1, 10)  # ...then one sample a second
    samples_per_s, tokens_per_s = meter.rates(30.0, started=0.0)
    assert samples_per_s == 1.0 and tokens_per_s == 10.0
    assert meter.samples == 110


def test_eta():
    assert eta_seconds(100, 2.0) == 50.0
    assert eta_seconds(0, 0.0) == 0.0
    assert eta_seconds(5, 0.0) is None
    assert format_duration(3661) == "01:01:01" and format_duration(90061) == "1d 01:01:01"
    assert format_duration(None) == "--:--:--"


def test_progress_line_shows_what_a_person_asks():
    line = render_line(Snapshot(done=250, total=1000, failed=3, samples_per_s=5.0, tokens_per_s=4321.0,
                                in_flight=64, elapsed_s=50.0))
    for part in ("250/1000", "25.0%", "failed 3", "4,321 tok/s", "5.00 samples/s", "in flight 64",
                 "ETA 00:02:30"):
        assert part in line


def test_the_eta_follows_the_lengths_left_not_the_sample_rate_of_the_dataset_running():
    # A long dataset (1,000-token answers, 0.1 samples/s at 100 tok/s) before a short one: 200 short samples of
    # 100 tokens take 200 s, not the 2,000 s samples/s says.
    snapshot = Snapshot(done=200, total=400, failed=0, samples_per_s=0.1, tokens_per_s=100.0, in_flight=8,
                        elapsed_s=600.0, tokens_left=200 * 100)
    assert snapshot.eta_s == 200.0
    assert Snapshot(done=400, total=400, failed=0, samples_per_s=0.0, tokens_per_s=100.0, in_flight=0,
                    elapsed_s=1.0, tokens_left=0.0).eta_s == 0.0


def test_the_meter_stays_small_and_exact_at_any_pace():
    """1,000 samples a second for 5 minutes: a bounded number of entries, and the window's rates as counted."""
    meter = ThroughputMeter(window_s=120)
    for tick in range(300 * 1000):
        meter.record(tick / 1000, 1, 7)
    assert len(meter._buckets) <= 121
    samples_per_s, tokens_per_s = meter.rates(300.0, started=0.0)
    assert abs(samples_per_s - 1000) / 1000 < 0.01 and tokens_per_s == 7 * samples_per_s
    assert meter.samples == 300_000
    assert meter.rates(500.0, started=0.0) == (0.0, 0.0), "nothing in the window once it has passed"
