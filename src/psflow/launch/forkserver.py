"""A fork server for the local launcher: import torch once, then fork every task from that process.

Each task of a local run is ``python -u SCRIPT ARGS`` with its own environment. Started as a fresh
interpreter, every one of them imports torch (about 1.5 s of CPU; three tasks on two cores take
over 2 s of wall time before anyone trains). The fork server is one interpreter that imports torch,
numpy and psflow once and then forks a child per task; the child becomes the task exactly as a fresh
``python -u SCRIPT`` would be: its own session (process group), output to the launcher's pipe, the
task's environment, working directory, ``sys.argv`` and ``sys.path[0]``, fresh random seeds, and the
script run as ``__main__``. Exceptions, ``sys.exit`` and signals behave as in a fresh interpreter,
because the child ends the way an interpreter running the script ends.

Protocol, over a ``SOCK_SEQPACKET`` Unix socket pair (one message per request or event, JSON):

    server -> {"ready": true}                                 (after the imports)
    client -> {"argv": [...], "env": {...}, "cwd": "..."} + the fd of the task's output pipe
    server -> {"spawned": PID} | {"error": "..."}             (PID has its own session by then)
    server -> {"exit": PID, "code": CODE}                     (CODE as Popen.returncode: -N for signal N)

The server exits when the client closes its end. It and its children die with their parent
(``PR_SET_PDEATHSIG``), like every task of the local launcher.

Used by :class:`psflow.launch.local.LocalBackend` for tasks whose command is ``python -u SCRIPT ...``
with this interpreter and whose environment differs from the launcher's only in ``PSFLOW_*``
variables (anything else, e.g. a thread-count variable that torch reads at import, gets a fresh
process). ``psflow run --no-preload`` turns it off.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

PRELOAD = ("torch", "numpy", "psflow.task", "psflow.train.trainer", "psflow.data")
# Imported once the server has been idle for IDLE_IMPORT_S (after the run's first tasks were forked):
# what a Supervisor imports on entry (TensorBoard's writer: about 0.6 s of CPU, 2.5 s of wall time on
# a loaded machine). A task forked later, a restarted one, then finds them imported; the first
# tasks are not delayed by them (they import them themselves, as before).
PRELOAD_IDLE = ("torch.utils.tensorboard", "psflow.summary", "psflow.supervisor")
IDLE_IMPORT_S = 1.0
_MAX_MESSAGE = 1 << 20


# --------------------------------------------------------------------------- the server process


def die_with_parent() -> None:
    """Get SIGTERM when the parent dies (even by SIGKILL): no task is left orphaned. Linux only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the launcher's own cleanup still stops every task


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def serve(sock: socket.socket) -> None:
    """Import the preloads, then fork a task per request until the client hangs up.

    Not preloaded: ``torch._dynamo`` (~1.2 s of CPU), which no task needs to start: a ps builds its
    ``torch.optim`` optimizers without it (``psflow.ps.service.build_optimizers_without_dynamo``).
    Imported here, it would delay every task.
    """
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    _send(sock, {"ready": True})
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    children: dict[int, int] = {}  # pidfd -> pid
    later = list(PRELOAD_IDLE)
    while True:
        events = poller.poll(int(IDLE_IMPORT_S * 1000) if later else None)
        if not events and later:
            _import_quietly(later.pop(0))
        for fd, _events in events:
            if fd != sock.fileno():
                pid = children.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 1)
            if not data:
                return  # the launcher is done (or gone)
            try:
                request = json.loads(data)
                argv, env, cwd = list(request["argv"]), dict(request["env"]), str(request["cwd"])
                if len(fds) != 1:
                    raise ValueError(f"expected one output fd, received {len(fds)}")
            except (ValueError, KeyError, TypeError) as e:
                for extra in fds:
                    os.close(extra)
                _send(sock, {"error": f"bad spawn request: {e}"})
                continue
            pid = _fork_task(argv, env, cwd, fds[0], sock, list(children))
            os.close(fds[0])
            pidfd = os.pidfd_open(pid)
            children[pidfd] = pid
            poller.register(pidfd, select.POLLIN)
            _send(sock, {"spawned": pid})


def _import_quietly(name: str) -> None:
    """A preload that may be missing (TensorBoard is optional for a task): the task reports it, if it needs it."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - the task imports it again and gets the real error
        return


def _fork_task(argv: list[str], env: dict[str, str], cwd: str, out_fd: int, sock: socket.socket, pidfds: list[int]) -> int:
    """Fork; in the child, become the task (never returns there). Returns the child's pid once it
    leads its own session, so that the launcher can signal its process group at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        sock.close()
        for fd in pidfds:
            os.close(fd)
        _become_task(argv, env, cwd, out_fd, ready_w)  # runs the script; ends like an interpreter
    os.close(ready_w)
    os.read(ready_r, 1)  # the child has its session (or died trying: EOF)
    os.close(ready_r)
    return pid


def _become_task(argv: list[str], env: dict[str, str], cwd: str, out_fd: int, ready_w: int) -> None:
    import runpy

    os.setsid()
    die_with_parent()
    os.write(ready_w, b"1")
    os.close(ready_w)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    _reseed()
    _set_threads(env)
    script = argv[2]
    sys.argv = [script, *argv[3:]]
    sys.path[0] = str(Path(script).resolve().parent)
    # From here the child is the task: the script's exceptions, sys.exit and signals end this
    # process exactly as they end `python -u SCRIPT` (traceback, exit code, atexit handlers).
    try:
        runpy.run_path(script, run_name="__main__")
    except Exception as e:  # noqa: BLE001  # SystemExit and KeyboardInterrupt end it as they end an interpreter
        # The traceback a fresh interpreter prints: from the script's frames on, not the fork server's.
        tb = _from_script(e.__traceback__, script)
        e.__traceback__ = tb  # the default hook prints the exception's own traceback
        from psflow.errorreport import ignore_stop_requests

        ignore_stop_requests()  # failing: it ends by itself, with its own exit code (1), as psflow's hook does
        if not getattr(sys.excepthook, "psflow_reports", False):  # failed before psflow.init installed its hook
            _write_error_report(env, e, tb)
        sys.excepthook(type(e), e, tb)
        sys.exit(1)
    sys.exit(0)


def _from_script(tb: TracebackType | None, script: str) -> TracebackType | None:
    """``tb`` without its leading frames outside ``script`` (this module's, runpy's)."""
    path = str(Path(script).resolve())
    t = tb
    while t is not None and str(Path(t.tb_frame.f_code.co_filename).resolve()) != path:
        t = t.tb_next
    return t or tb


def _write_error_report(env: Mapping[str, str], e: BaseException, tb: TracebackType | None) -> None:
    """The task's JSON error report (as psflow.task writes it) for an error raised before the script
    called psflow.init(), e.g. at import: the launcher then names it as the root cause."""
    from psflow import errorreport

    path = env.get("PSFLOW_ERROR_FILE")
    if path:
        errorreport.write(path, env.get("PSFLOW_TASK", ""), e, tb)  # on failure, the log still has the traceback


def _set_threads(env: Mapping[str, str]) -> None:
    """The task's torch threads, set before its script runs (so that the script's own
    ``torch.set_num_threads`` wins). A fresh interpreter gets them as OMP_NUM_THREADS instead, which
    torch reads at import; here torch was imported by the server, with the server's count."""
    threads = env.get("PSFLOW_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _reseed() -> None:
    """A fresh interpreter seeds torch and numpy from the OS; forked children would share the
    server's state. (Python's ``random`` reseeds itself at fork.)"""
    import torch

    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def main() -> None:
    """The server process: ``python -u -c "...main()" FD``."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    serve(socket.socket(fileno=int(sys.argv[1])))
    # Only the server gets here (a forked task ends inside serve). Nothing to clean up: skip the
    # interpreter's teardown of everything torch loaded (~0.6 s the launcher would wait for).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the launcher's side


class ForkedTask:
    """The part of ``subprocess.Popen`` the launcher uses, for a task forked by the server."""

    def __init__(self, pid: int, argv: Sequence[str], stdout: Any, server: ForkServer) -> None:
        self.pid = pid
        self.args = list(argv)
        self.stdout = stdout
        self._server = server
        self._done = threading.Event()
        self.returncode: int | None = None

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """Start the fork server and ask it for tasks. Not thread-safe for concurrent ``spawn`` calls."""

    def __init__(self, python: str = sys.executable, *, log_path: str | os.PathLike[str] | None = None) -> None:
        self.python = python
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 (the server's lifetime)
        try:
            self._proc = subprocess.Popen(
                [python, "-u", "-c", "from psflow.launch.forkserver import main; main()", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, preexec_fn=die_with_parent,
            )
        finally:
            theirs.close()
            if log is not subprocess.DEVNULL:
                log.close()
        self._tasks: dict[int, ForkedTask] = {}
        self._early_exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._ready = False
        self._closed = False
        threading.Thread(target=self._read, name="psflow-forkserver-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:  # the server is gone: so are its children (PR_SET_PDEATHSIG)
                    self._closed = True
                    for task in self._tasks.values():
                        if task.returncode is None:
                            task._exited(-signal.SIGTERM)
                    self._cond.notify_all()
                    return
                message = json.loads(data)
                if "ready" in message:
                    self._ready = True
                elif "exit" in message:
                    pid, code = int(message["exit"]), int(message["code"])
                    task = self._tasks.get(pid)
                    if task is not None:
                        task._exited(code)
                    else:  # exited before spawn() registered it (a task that dies at once)
                        self._early_exits[pid] = code
                else:
                    self._replies.append(message)
                self._cond.notify_all()

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the server has imported its preloads; False if it failed or took too long."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._closed, timeout_s)
            return self._ready and not self._closed

    def usable_for(self, argv: Sequence[str], env: Mapping[str, str], base_env: Mapping[str, str]) -> bool:
        """Whether a task can be forked rather than started fresh: ``python -u SCRIPT.py ...`` with
        this interpreter, and an environment that differs from ``base_env`` only in PSFLOW_* keys."""
        if len(argv) < 3 or argv[0] != self.python or argv[1] != "-u" or not argv[2].endswith(".py"):
            return False
        keys = set(env) | set(base_env)
        return all(k.startswith("PSFLOW_") or env.get(k) == base_env.get(k) for k in keys)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, timeout_s: float = 30.0) -> ForkedTask:
        """Fork a task; its output (stdout and stderr) comes out of the returned task's ``stdout``."""
        r, w = os.pipe()
        try:
            socket.send_fds(self._sock, [json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()], [w])
        except OSError as e:
            os.close(r)
            raise OSError(f"the fork server is gone ({e}); start the task without it") from e
        finally:
            os.close(w)
        with self._cond:
            if not self._cond.wait_for(lambda: self._replies or self._closed, timeout_s) or not self._replies:
                os.close(r)
                raise OSError("the fork server did not answer a spawn request; start the task without it")
            reply = self._replies.pop(0)
            if "error" in reply:
                os.close(r)
                raise OSError(f"the fork server refused a spawn request: {reply['error']}")
            task = ForkedTask(int(reply["spawned"]), argv, os.fdopen(r, "r", buffering=1), self)
            self._tasks[task.pid] = task
            if task.pid in self._early_exits:
                task._exited(self._early_exits.pop(task.pid))
        return task

    def close(self, timeout_s: float = 10.0) -> None:
        """Hang up; the server exits (its tasks should have exited already)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=timeout_s)

