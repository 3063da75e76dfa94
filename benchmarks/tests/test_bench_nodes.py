from benchmarks import bench_nodes


def test_two_node_layout_starts_two_agents_at_one_rendezvous():
    one = bench_nodes.layout_commands(bench_nodes.LAYOUTS[0])
    assert len(one) == 1 and "--nproc_per_node" in one[0] and one[0][one[0].index("--nproc_per_node") + 1] == "2"
    nodes = bench_nodes.layout_commands(bench_nodes.LAYOUTS[1])
    assert [cmd[cmd.index("--node_rank") + 1] for cmd in nodes] == ["0", "1"]
    endpoints = {cmd[cmd.index("--rdzv_endpoint") + 1] for cmd in nodes}
    assert len(endpoints) == 1 and endpoints.pop().startswith("127.0.0.1:")
    assert all(cmd[cmd.index("--nnodes") + 1] == "2" and cmd[-1].endswith("blenderbot.py") for cmd in nodes)


def test_summary_pairs_each_repeat_with_its_one_node_run():
    def row(layout, rate, nodes):
        return {"config": "zero3", "layout": layout, "samples_per_second": rate, "train_loss": 6.5, "nodes": nodes,
                "ranks_per_node": 2 // nodes, "zero_stage": 3, "fsdp": None}  # fmt: skip

    one, two = bench_nodes.LAYOUTS
    rows = [row(one, 10.0, 1), row(two, 5.0, 2), row(one, 10.0, 1), row(two, 20.0, 2)]  # ratios 0.5 and 2
    summary = {r["layout"]: r for r in bench_nodes.summarize(rows)}
    assert abs(summary[two]["ratio_to_one_node"][0] - 1.0) < 1e-12  # geometric mean of 0.5 and 2
    assert summary[two]["median_samples_per_second"] == 12.5 and summary[two]["label"] == "ZeRO-3"
    assert summary[two]["losses"] == [6.5] and summary[one]["ratio_to_one_node"][0] == 1.0
