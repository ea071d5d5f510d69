"""Naming the DataLoader worker behind an error that does not name it: the worker a timed-out batch
was waited from, or a worker that died. DeviceLoader adds the name as a note to the loader's own error,
whose message and class stay DataLoader's."""

from __future__ import annotations

import multiprocessing.connection
import signal
import time
from typing import Any

from .._torch_compat import loader_workers, waited_worker

__all__ = ["name_the_waited_worker"]

# How long a lost connection waits for its worker to be reaped before saying none had exited.
_REAP_WAIT_S = 5.0


def name_the_waited_worker(error: BaseException, source: Any) -> None:
    """Adds a note (the message and the class stay DataLoader's) naming the worker behind an error that
    does not: the worker a timed-out batch was waited from, or a worker that died (a killed worker can
    surface as ``ConnectionResetError`` while its last batch's shared memory is fetched). ``source``:
    the DataLoader iterator the error came from; anything else (no workers) adds nothing."""
    if not hasattr(error, "add_note"):
        return
    try:
        workers = loader_workers(source)
        if not workers:  # no DataLoader workers: the error is the dataset's own, as raised
            return
        worker = waited_worker(source)
        if str(error).startswith("DataLoader timed out") and worker is not None:
            error.add_note(f"fastcollate.DeviceLoader: the batch waited for was DataLoader worker {worker}'s "
                           f"(pid {workers[worker].pid})")
            return
        lost_connection = isinstance(error, (ConnectionError, EOFError, FileNotFoundError))
        if lost_connection:
            _wait_for_an_exit(workers)
        named = _note_dead_workers(error, workers)
        if lost_connection and not named:
            pids = ", ".join(str(worker.pid) for worker in workers)
            error.add_note(f"fastcollate.DeviceLoader: the connection to a DataLoader worker failed while "
                           f"a batch was received; no worker had exited {_REAP_WAIT_S:g} s later "
                           f"(workers: pids {pids})")
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return


def _wait_for_an_exit(workers: list[Any]) -> None:
    """The worker's sockets close an instant before it can be reaped: waits for that (bounded)."""
    deadline = time.monotonic() + _REAP_WAIT_S
    while not any(worker.exitcode for worker in workers) and time.monotonic() < deadline:
        multiprocessing.connection.wait([worker.sentinel for worker in workers], timeout=0.1)


def _note_dead_workers(error: BaseException, workers: list[Any]) -> bool:
    """Notes each worker that exited with an error or a signal, unless the message already names its
    pid (DataLoader's own message for a worker it saw die); True when one was noted."""
    named = False
    for index, worker in enumerate(workers):
        code = worker.exitcode
        if code and str(worker.pid) not in str(error):
            how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            error.add_note(f"fastcollate.DeviceLoader: DataLoader worker {index} (pid {worker.pid}) "
                           f"died ({how})")
            named = True
    return named
