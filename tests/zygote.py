"""A process that imports torch and pyengine once and then forks one child per process that a multi-process test
starts (tests/test_distributed.py's ranks, tests/test_cli.py's ``pyengine train`` ranks): each would otherwise
spend seconds of a 2-core machine importing them, several at once, in every such test. A child is the process that
``python SCRIPT ARGS``, ``python -m MODULE ARGS`` or ``python -c CODE ARGS`` would be from its first line on: its own
argv, ``sys.path[0]``, environment, working directory, stdout and stderr (files), ``__main__``; and it exits as
that process would (an uncaught exception prints its traceback and exits 1, ``sys.exit(n)`` exits n, interpreter
shutdown joins its threads and runs its atexit handlers).

Run as a script it is the server; imported, :func:`start` is the tests' face of it (one server per rank index in a
test process, started at its first use). ``PYENGINE_TEST_ZYGOTE=0`` makes :func:`start` run a fresh interpreter instead (the same
process otherwise), to tell a failure of the forked processes from one of the code.

Protocol (one line each, stdin and stdout of the server):
    -> {"argv": [...], "env": {...}, "stdout": path, "stderr": path, "cwd": path or null}
       argv as after ``python``: [script, ...], ["-m", module, ...] or ["-c", code, ...]
    <- ready                                                once, when the imports are done
    <- started <pid>                                        a reply per request, in order
    <- exited <pid> <code>                                  when it ends (code as subprocess.Popen.returncode)
End of stdin ends the server (its children are the tests' to end).

Fork is safe here because the server is single-threaded when it forks (checked at start: importing torch and
pyengine with OMP_NUM_THREADS=1 starts no thread) and has run no torch op (no OpenMP pool, no autograd thread exists
to be lost)."""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# ---- the tests' side ----------------------------------------------------------------------------------------------

class _Server:
    def __init__(self):
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.codes, self.pending = {}, b""
        assert self._line(120.0) == "ready", "tests/zygote.py did not start (its stderr is in the test's output)"

    def _line(self, timeout):
        """The next reply line, or None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            remaining = max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], remaining)[0]:
                return None
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                raise RuntimeError(f"tests/zygote.py ended (exit {self.proc.wait()})")
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode()

    def _exited(self, line):
        what, pid, code = line.split()
        assert what == "exited", line
        self.codes[int(pid)] = int(code)

    def pump(self, timeout):
        """Waits up to ``timeout`` s for a reply, then records every exit code that has arrived."""
        line = self._line(timeout)
        while line is not None:
            self._exited(line)
            line = self._line(0.0)

    def start(self, argv, env, stdout, stderr=None, cwd=None):
        request = dict(argv=list(argv), env=dict(env), stdout=str(stdout), stderr=str(stderr or stdout),
                       cwd=None if cwd is None else str(cwd))
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            line = self._line(60.0)
            assert line is not None, "tests/zygote.py does not answer"
            if line.startswith("started "):
                return Forked(self, int(line.split()[1]))
            self._exited(line)

    def close(self):
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)

    _running = {}

    @classmethod
    def get(cls, key):
        if key not in cls._running or cls._running[key].proc.poll() is not None:
            cls._running[key] = cls()
        return cls._running[key]


class Forked:
    """A process forked by the server, with the part of subprocess.Popen's face the tests use."""

    def __init__(self, server, pid):
        self.server, self.pid = server, pid

    @property
    def returncode(self):
        return self.server.codes.get(self.pid)

    def poll(self):
        self.server.pump(0.0)
        return self.returncode

    def wait(self, timeout):
        deadline = time.monotonic() + timeout
        while self.returncode is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            self.server.pump(remaining)
        return self.returncode

    def kill(self):
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start(argv, env, stdout, stderr=None, cwd=None, rank=0):
    """``python *argv`` with ``env`` in ``cwd``, its stdout written to the file ``stdout`` and its stderr to
    ``stderr`` (None: the same file): forked by the server of ``rank``, or (``PYENGINE_TEST_ZYGOTE=0``) a fresh
    interpreter. Returns a Popen or a :class:`Forked` (``wait(timeout)``, ``poll()``, ``kill()``, ``returncode``).

    Each rank has a server of its own: the children of one server share its string hash seed (PYTHONHASHSEED is
    drawn at an interpreter's start), so ranks forked from one would iterate a set of names in the same order where
    separate processes need not, and a test could not catch an engine that relies on it."""
    if os.environ.get("PYENGINE_TEST_ZYGOTE", "1") == "0":
        with open(stdout, "w") as out:
            if stderr is None:
                return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=out,
                                        stderr=subprocess.STDOUT)
            with open(stderr, "w") as err:
                return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=out, stderr=err)
    return _Server.get(rank).start(argv, env, stdout, stderr, cwd)


def free_port() -> int:
    """A local TCP port free a moment ago, for MASTER_PORT. Another process may take it before rank 0 binds it: a
    launcher whose rank 0 then said EADDRINUSE runs its ranks again on another port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- the server ---------------------------------------------------------------------------------------------------

def _serve():
    """Answers requests until one forks: returns that request in the child (the server never returns)."""
    threads = os.listdir("/proc/self/task")
    if len(threads) != 1:
        sys.exit(f"zygote: importing torch and pyengine left {len(threads)} threads (OMP_NUM_THREADS="
                 f"{os.environ.get('OMP_NUM_THREADS')!r}: more than 1 starts OpenBLAS's pool); forking would be unsafe")
    requests, replies = os.dup(0), os.dup(1)  # the children get fresh 0/1/2: these stay the server's own
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    os.write(replies, b"ready\n")
    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.02)
        while True:  # reap every child that ended (none waits for another's exit)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            os.write(replies, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())
        if not ready:
            continue
        data = os.read(requests, 1 << 16)
        if not data:
            sys.exit(0)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(replies)
                return request
            os.write(replies, f"started {pid}\n".encode())


def _become(job):
    """The child: the process ``python *job["argv"]`` would be, from its first line on."""
    import runpy
    import types

    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        if fd == 2 and path == job["stdout"]:
            os.dup2(1, 2)
            continue
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    # PYTHONPATH is read at start-up: the server's entries in sys.path become the child's (the modules the server
    # imported stay as they are: every test gives its processes the server's, the repository)
    served = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    own = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    if served and sys.path[1:1 + len(served)] == [os.path.abspath(p) for p in served]:
        sys.path[1:1 + len(served)] = [os.path.abspath(p) for p in own]
    os.environ.clear()
    os.environ.update(job["env"])
    if job["cwd"] is not None:
        os.chdir(job["cwd"])
    argv = job["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import pyengine  # noqa: F401
    import pyengine.cli  # noqa: F401 (python -m pyengine)
    import pyengine.pipeline_distributed  # noqa: F401 (the ranks of a pipeline import it: seconds more each)
    import pyengine.plots  # noqa: F401 (the CLI's plots: matplotlib)
    from pyengine import checkpoint, distributed  # noqa: F401

    _become(_serve())
