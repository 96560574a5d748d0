"""Where the backend sends each plan it makes: the `fxmem` logger, tlparse, and dump folders.

* Logging goes to the `fxmem` logger; `TORCH_LOGS=+fxmem` (or `torch._logging.set_logs(fxmem=
  logging.DEBUG)`) shows it, since the name is registered with torch's logging on import.
* With `TORCH_TRACE=dir` set, every plan is also a tlparse artifact named `fxmem_plan`.
* With `FXMEM_DUMP=dir` in the environment, or the backend option `dump="dir"`, every plan is
  saved with all its files into a new folder under `dir` (see `Plan.save`).
"""

from __future__ import annotations

import json
import logging
import os
import threading

from fxmem import _torch_private as tp
from fxmem.plan import Plan, format_bytes

__all__ = ["DUMP_ENV", "dump_dir", "emit_plan"]

DUMP_ENV = "FXMEM_DUMP"
log = logging.getLogger("fxmem")
_lock = threading.Lock()
_dumped = 0


def dump_dir(option: str | os.PathLike | None) -> str | None:
    """The folder plans are dumped into: the option, else $FXMEM_DUMP, else None."""
    if option is not None:
        return os.fspath(option)
    return os.environ.get(DUMP_ENV) or None


def emit_plan(plan: Plan, dump: str | os.PathLike | None, region: object = None) -> str | None:
    """Log `plan`, emit it to tlparse, and save it under the dump folder if there is one;
    returns the folder it was saved in."""
    log.debug("plan for region %s:\n%s", region, plan.summary(top=20))
    tp.trace_artifact("fxmem_plan", lambda: json.dumps(plan.to_dict(), separators=(",", ":")))
    directory = dump_dir(dump)
    if directory is None:
        return None
    global _dumped
    with _lock:
        _dumped += 1
        sub = os.path.join(directory, f"plan_{os.getpid()}_{_dumped:03d}")
    try:
        plan.save(sub)
    except OSError as e:  # a dump must never break training
        log.warning("fxmem could not write the plan to %s: %s", sub, e)
        return None
    log.info(
        "fxmem plan (peak %s, budget %s) written to %s",
        format_bytes(plan.predicted_peak_bytes),
        "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes),
        sub,
    )
    return sub


tp.register_log_name()
