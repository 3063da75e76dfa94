"""How a distributed process exits after ``hf_ext.end_distributed()``: its engines and process groups are torn down
in order, then the interpreter skips its final garbage collections (``hf_ext.runtime.exit_without_final_collections``:
about 1 s of every rank's exit, docs/benchmarks.md "How long the ranks take to exit").

The oracle is Python's own exit: a reference cycle that only the collector can free, with a finalizer that says when
it is freed. A process that tears its process group down itself frees it at exit; one that called ``end_distributed``
leaves it to the OS. (That no rank aborts at exit with it: the 2-rank launches of the suite, every one of which calls
``end_distributed`` last, and ``benchmarks/bench_exit.py``.)
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from ..conftest import free_port, run_side_by_side

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import gc, sys
    import torch.distributed as dist
    gc.disable()  # nothing but the final collections frees the cycle
    class Cycle:
        def __del__(self):
            print("collected at exit", flush=True)
    cycle = Cycle(); cycle.me = cycle; del cycle
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0, world_size=1)
    if sys.argv[1] == "end_distributed":
        import hf_ext
        hf_ext.end_distributed()
    else:
        dist.destroy_process_group()
    print("torn down:", dist.is_initialized(), flush=True)
""")


def test_end_distributed_exits_without_the_final_collections():
    own, ended = run_side_by_side([[sys.executable, "-c", SCRIPT, mode, str(free_port())]
                                   for mode in ("destroy_process_group", "end_distributed")])  # fmt: skip
    assert own.returncode == ended.returncode == 0, own.stderr[-2000:] + ended.stderr[-2000:]
    assert own.stdout.splitlines()[-2:] == ["torn down: False", "collected at exit"]
    assert ended.stdout.splitlines()[-1] == "torn down: False"
    assert "collected at exit" not in ended.stdout
