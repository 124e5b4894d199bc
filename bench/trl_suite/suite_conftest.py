"""conftest.py the harness puts next to TRL's test files (it replaces TRL's own conftest.py).

Two jobs:

* Bridge the gap between the version of TRL's test files and the installed TRL 1.16 where a test
  *module* would not even import: the stored test files import helpers that TRL 1.16 no longer has
  (``trl.trainer.utils.get_kbit_device_map``, used only by a GPU-only test, and two
  ``trl.import_utils`` probes used only by ``testing_utils``' decorators). Each stand-in is added only
  when TRL lacks the name, and only to let collection proceed; no trainer behaviour is touched.
* Let training run on a machine without an accelerator. TRL's configs default to ``bf16=True``,
  which ``transformers.TrainingArguments`` refuses on CPU unless ``use_cpu=True`` ("You need to
  assign use_cpu if you want to train the model on CPU"); TRL's CI runs these tests on GPUs. With no
  CUDA device, ``TrainingArguments.__post_init__`` is wrapped to set ``use_cpu=True`` first, for both
  runs alike (grouprl's config inherits it once it subclasses ``TrainingArguments``).
* Record every test's outcome and the first line of its failure into the JSON file named by
  ``TRL_SUITE_REPORT`` (the harness reads it; junit XML loses xfail/xpass details).
"""

import gc
import importlib.util
import json
import os

import pytest


def _add_missing_trl_helpers() -> list[str]:
    added = []
    try:
        import trl.import_utils as import_utils
        import trl.trainer.utils as trainer_utils
    except ImportError:
        return added

    def probe(module_name):
        return lambda: importlib.util.find_spec(module_name) is not None

    for name, module_name in (("is_joblib_available", "joblib"), ("is_llm_blender_available", "llm_blender")):
        if not hasattr(import_utils, name):
            setattr(import_utils, name, probe(module_name))
            added.append(f"trl.import_utils.{name}")
    if not hasattr(trainer_utils, "get_kbit_device_map"):

        def kbit_device_map():  # where a k-bit model would be placed: the current accelerator, else CPU
            import torch

            return {"": torch.cuda.current_device()} if torch.cuda.is_available() else None

        trainer_utils.get_kbit_device_map = kbit_device_map
        added.append("trl.trainer.utils.get_kbit_device_map")
    return added


def _train_on_cpu_without_accelerator() -> list[str]:
    import torch
    import transformers

    if torch.cuda.is_available():
        return []
    original = transformers.TrainingArguments.__post_init__

    def post_init(self):
        self.use_cpu = True
        original(self)

    transformers.TrainingArguments.__post_init__ = post_init
    return ["transformers.TrainingArguments: use_cpu=True (no CUDA device)"]


SHIMS = _add_missing_trl_helpers() + _train_on_cpu_without_accelerator()
_RESULTS: dict[str, dict] = {}
_COLLECTED: list[str] = []


def _first_line(report) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        text = crash.message
    elif isinstance(report.longrepr, tuple):  # skips: (path, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr or "")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:400] if lines else ""


def pytest_runtest_logreport(report):
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": None, "message": "", "duration": 0.0})
    entry["duration"] += report.duration
    xfail = hasattr(report, "wasxfail")
    if report.when == "setup" and report.skipped:
        entry.update(
            outcome="xfailed" if xfail else "skipped", message=_first_line(report) if not xfail else report.wasxfail
        )
    elif report.when == "setup" and report.failed:
        entry.update(outcome="error", message=_first_line(report))
    elif report.when == "call":
        if xfail and report.skipped:
            entry.update(outcome="xfailed", message=report.wasxfail)
        elif xfail and report.passed:
            entry.update(outcome="xpassed", message=report.wasxfail)
        elif report.skipped:
            entry.update(outcome="skipped", message=_first_line(report))
        else:
            entry.update(outcome=report.outcome, message=_first_line(report) if report.failed else "")
    elif report.when == "teardown" and report.failed and entry["outcome"] == "passed":
        entry.update(outcome="error", message="teardown: " + _first_line(report))


def pytest_collectreport(report):
    if report.failed:  # a module that does not import: every test in it is lost, say so
        _RESULTS[report.nodeid or "<collection>"] = {
            "outcome": "collection-error",
            "message": _first_line(report),
            "duration": 0.0,
        }


def pytest_collection_finish(session):
    _COLLECTED.extend(item.nodeid for item in session.items)


def pytest_sessionfinish(session, exitstatus):
    # Also written when the run is interrupted (Ctrl-C): tests collected but not reached are listed as such.
    path = os.environ.get("TRL_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"shims": SHIMS, "collected": _COLLECTED, "tests": _RESULTS}, f, indent=1)


@pytest.fixture(autouse=True)
def _collect_garbage():
    yield
    gc.collect()
