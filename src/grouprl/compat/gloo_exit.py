"""Stop gloo's threads before the interpreter exits, in scripts that never end their process group.

TRL's scripts and most users' end after ``trainer.train()`` / ``save_model()``. Gloo's worker threads
(``pt_gloo_runloop``, ``gloo_tcp_loop``) then meet the interpreter's teardown and now and then abort a finished
run with SIGABRT ("terminate called without an active exception", pytorch/pytorch#190489).

``destroy_process_group()`` alone does not stop them: it only unregisters the group. The threads belong to the
group object, which lives on while a DistributedDataParallel wrapper holds it (its ``process_group``, its
``reducer`` and the ``logger`` that keeps the reducer), and the trainer keeps that wrapper. So at exit grouprl
ends the group, lets go of those three references in the wrappers it prepared, and collects: the group object is
then freed and joins its threads while the interpreter is still whole.

One more holder is torch's: ``torch.distributed.nn.functional``'s collectives take ``group.WORLD`` as a default
argument, evaluated when the module is imported. torch._dynamo imports it, and when that first happens after the
group was made (a DDP wrapper's construction imports dynamo), those defaults hold the group for the process's
life. At exit they are set back to None, what they are when imported before any group (None means the default
group there).

Only gloo (CPU processes): ending a gloo group is local to the process, where NCCL's teardown involves its peers.
"""

from __future__ import annotations

import atexit
import functools
import gc
import sys
import types
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

# DistributedDataParallel's attributes that keep its process group alive
_GROUP_HOLDERS = ("reducer", "logger", "process_group")
_wrappers: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def gloo_only() -> bool:
    """True if this process is in a process group whose every backend is gloo."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    # "cpu:gloo" or "cpu:gloo,cuda:nccl" (get_backend() says "undefined" for a group set up per device type)
    backends = {entry.split(":")[-1] for entry in str(torch.distributed.get_backend_config()).split(",")}
    return backends == {"gloo"}


def stop_gloo_at_exit(prepared_model: torch.nn.Module) -> None:
    """In a gloo process group, make sure its threads are stopped at interpreter exit (once per process), including
    the group that ``prepared_model`` (accelerate's DistributedDataParallel wrapper) holds."""
    if not gloo_only():
        return
    if isinstance(prepared_model, DistributedDataParallel):
        _wrappers.add(prepared_model)
    _register_exit_handler()


@functools.cache  # one handler per process
def _register_exit_handler() -> None:
    atexit.register(stop_gloo_threads)


def stop_gloo_threads() -> None:
    """End the gloo group if the script has not (``trainer.end()`` does), and free it: its threads join now."""
    if gloo_only():
        torch.distributed.destroy_process_group()
    for wrapper in list(_wrappers):
        for name in _GROUP_HOLDERS:
            vars(wrapper).pop(name, None)
    _wrappers.clear()
    _release_collective_defaults()
    gc.collect()  # the group and the wrappers' reducers sit in reference cycles with the trainer


def _release_collective_defaults() -> None:
    """Set `torch.distributed.nn.functional`'s process-group default arguments back to None (module doc)."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    if functional is None:  # not imported: nothing holds the group
        return
    for function in vars(functional).values():
        if isinstance(function, types.FunctionType) and function.__defaults__:
            function.__defaults__ = tuple(
                None if isinstance(value, torch.distributed.ProcessGroup) else value for value in function.__defaults__
            )
