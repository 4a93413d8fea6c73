"""engine_rank_skew_ratio: high-class step time over same-size lowest-class step time, per bucket."""

from prometheus_client import REGISTRY

from services.worker.engine.rank_skew import RankSkew, token_bucket


def gauge(rank_class: str, bucket: str) -> float | None:
    return REGISTRY.get_sample_value("engine_rank_skew_ratio", {"rank_class": rank_class, "batch_tokens": bucket})


def test_token_buckets_are_powers_of_two():
    assert [token_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 600)] == [1, 2, 4, 4, 8, 8, 16, 1024]


def test_the_ratio_compares_running_means_of_the_same_bucket_only():
    skew = RankSkew(lowest_class=4)  # a class no other test's engine uses: the gauge's series are its own
    skew.observe((4, 128), 8, 30.0)
    assert skew.ratio(128, 8) is None and gauge("128", "8") is None  # no lowest-class-only step of size 8 yet
    skew.observe((4,), 7, 10.0)
    skew.observe((4,), 8, 20.0)  # mean 15 ms at bucket 8
    assert skew.ratio(128, 8) == 2.0 and gauge("128", "8") == 2.0
    skew.observe((128,), 5, 45.0)  # highest class 128 again: mean (30 + 45) / 2 = 37.5
    assert gauge("128", "8") == 2.5
    skew.observe((4,), 64, 1.0)  # another bucket leaves bucket 8 alone
    assert gauge("128", "8") == 2.5 and gauge("128", "64") is None
    skew.observe((), 8, 1000.0)  # a base-only step is no rank class's
    assert gauge("128", "8") == 2.5
