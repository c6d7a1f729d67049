"""benchmarks/profile_step.py's GPU timeline: the union of overlapping device intervals
(PDL-launched kernels overlap) and the idle gaps between them."""
from types import SimpleNamespace

import torch
from bench_scripts import load_benchmark


def test_busy_time_is_the_union_and_gaps_are_what_lies_between():
    module = load_benchmark("profile_step")
    # [0, 10) and [5, 12) overlap; [12, 13) touches; then 7 idle; [20, 25) inside [20, 30).
    busy, span, gaps = module.busy_and_gaps([(20, 25), (0, 10), (5, 12), (12, 13), (20, 30)])
    assert (busy, span, gaps) == (23, 30, [7])


def test_timeline_counts_the_input_ops_and_long_gaps():
    module = load_benchmark("profile_step")
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event("Memcpy HtoD (Pinned -> Device)", 0, 1), event("_gemv_kernel", 1.5, 10),
              event("_decode_split_kernel", 9, 20), event("cudaGraphLaunch", 0, 30, cpu),
              event("void at::native::index_elementwise_kernel", 25, 26), event("_gemv_kernel", 26, 40)]
    line = module.timeline(events, steps=2)
    # busy 1 + 18.5 + 15 = 34.5 of 40: one gap of 5 (the 0.5 one is below 2 us); two input ops of 1 us
    assert "busy 17.2 of 20.0 us (86.2%)" in line
    assert "0.5 gaps of 2 us or more, 2.5 us in all (largest 5.0)" in line
    assert "input copies and torch kernels: 1.0, 1.0 us" in line
    assert module.timeline([event("cudaGraphLaunch", 0, 1, cpu)], steps=1).endswith("no device activity recorded")
