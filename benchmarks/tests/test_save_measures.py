"""What bench_save's cross-check counts: the peak of live tensor bytes, from allocation events and from the profiler,
against values worked out by hand."""

from __future__ import annotations

from benchmarks import harness
from benchmarks.bench_save import peak_without_file_maps


def test_peak_live_bytes_of_allocations_and_frees():
    # live after each event: 4000, 12000, 8000, 8500, 500, 0, 12000 -> the first 12000 is the peak
    events = [(0, 4000), (1, 8000), (2, -4000), (3, 500), (4, -8000), (5, -500), (6, 12000)]
    assert harness.peak_live_bytes(events) == 12000


def test_peak_live_bytes_takes_events_in_time_order():
    # given out of order; in time order: +100, +50, -100, +30 -> 100, 150, 50, 80
    events = [(30, -100), (10, 100), (40, 30), (20, 50)]
    assert harness.peak_live_bytes(events) == 150


def test_frees_of_older_blocks_never_raise_the_peak():
    # a block allocated before the window is freed first: -64 then +32, +16 -> -64, -32, -16; nothing rose above 0
    assert harness.peak_live_bytes([(0, -64), (1, 32), (2, 16)]) == 0
    assert harness.peak_live_bytes([]) == 0


def test_peak_without_the_storages_that_map_a_saved_file(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.safetensors").write_bytes(b"x" * 60)
    (tmp_path / "config.json").write_bytes(b"x" * 30)  # not a weight file: a 30-byte tensor still counts
    # all events: 40, 140, 170, 70, 130, 70, 30 -> 170; less the 100- and 60-byte maps: 40, 70, 30 -> 70
    events = [(0, 40), (1, 100), (2, 30), (3, -100), (4, 60), (5, -60), (6, -40)]
    assert harness.peak_live_bytes(events) == 170
    assert peak_without_file_maps(events, tmp_path) == 70


def test_peak_tensor_bytes_counts_the_tensors_allocated_inside():
    import torch

    before = torch.ones(1 << 16)  # allocated before the window; freeing it inside does not count
    with harness.PeakTensorBytes() as measured:
        a = torch.empty(1 << 18, dtype=torch.float32)  # 1 MiB
        b = torch.empty(1 << 17, dtype=torch.float32)  # 0.5 MiB: 1.5 MiB live, the peak
        del a, before
        c = torch.empty(1 << 16, dtype=torch.float32)  # 0.25 MiB: 0.75 MiB live
    assert measured.peak == 4 * ((1 << 18) + (1 << 17)) == 1572864
    assert [nbytes for _, nbytes in measured.events] == [1 << 20, 1 << 19, -(1 << 20), 1 << 18]  # b, c outlive it
    del b, c


def test_disabled_peak_tensor_bytes_measures_nothing():
    with harness.PeakTensorBytes(enabled=False) as measured:
        pass
    assert measured.peak is None and measured.events == []
