"""grouprl.compat.gloo_exit: at exit a gloo process group is ended and freed, so its threads join before the
interpreter's teardown (where they now and then abort a finished run), even while a DDP wrapper holds it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import free_port

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    if sys.argv[3] == "dynamo_first":  # as a trainer's imports do; else the DDP wrapper imports it, after the group
        import torch._dynamo
    from grouprl.compat.gloo_exit import stop_gloo_at_exit, stop_gloo_threads
    from helpers import gloo_threads

    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
    model(torch.ones(4, 3)).sum().backward()  # the reducer has all-reduced once
    kept = [model]  # as the trainer keeps its wrapper
    stop_gloo_at_exit(model)
    before = gloo_threads()
    if sys.argv[2] == "end_first":  # what trainer.end() does: ends the group, the wrapper still holds it
        torch.distributed.destroy_process_group()
    ended_only = gloo_threads()
    stop_gloo_threads()  # what runs at exit
    print(json.dumps({"before": before, "ended_only": ended_only, "after": gloo_threads(),
                      "initialized": torch.distributed.is_initialized()}))
    """
)


def run(mode: str, imports: str = "dynamo_by_ddp") -> dict:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(free_port()), mode, imports],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},  # grouprl and tests/helpers.py
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.e2e
@pytest.mark.parametrize("imports", ["dynamo_first", "dynamo_by_ddp"])
def test_the_exit_handler_stops_the_threads_of_a_group_that_a_ddp_wrapper_holds(imports):
    """Whether torch._dynamo was imported before the group or after it (then torch's collectives hold the group in
    their default arguments, gloo_exit's doc)."""
    state = run("leave_it", imports)
    assert state["before"]  # the group's threads ran
    assert state["after"] == [] and not state["initialized"]


@pytest.mark.e2e
def test_ending_the_group_alone_leaves_its_threads_and_the_exit_handler_stops_them():
    state = run("end_first")
    assert state["ended_only"] == state["before"] != []  # why destroy_process_group is not enough
    assert state["after"] == [] and not state["initialized"]
