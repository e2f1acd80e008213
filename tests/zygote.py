"""A process that imports torch and pyengine once and then forks one child per rank that tests/test_distributed.py
starts: each rank would otherwise spend seconds of a 2-core machine importing them, several ranks at once, in every
multi-process test. A child is a rank exactly as ``python tests/dist_job.py ...`` would be from its first line on:
it runs the script as ``__main__`` with its own argv, environment and log (stdout and stderr), and exits as that
process would (an uncaught exception prints its traceback and exits 1, ``sys.exit(n)`` exits n, interpreter shutdown
joins its threads and runs its atexit handlers).

Protocol (one line each, stdin and stdout):
    -> {"argv": [...], "env": {...}, "log": path}          a rank to start
    <- ready                                                once, when the imports are done
    <- started <pid>                                        a reply per request, in order
    <- exited <pid> <code>                                  when it ends (code as subprocess.Popen.returncode)
End of stdin ends the zygote (its children are the test's to end).

Fork is safe here because this process is single-threaded when it forks (checked at start: importing torch and
pyengine with OMP_NUM_THREADS=1 starts no thread) and has run no torch op (no OpenMP pool, no autograd thread exists to be lost)."""
import json
import os
import runpy
import select
import sys

import torch
import torch.distributed

import pyengine
import pyengine.pipeline_distributed  # noqa: F401 (the ranks of a pipeline import it: seconds more each)
from pyengine import checkpoint, distributed  # noqa: F401

threads = os.listdir("/proc/self/task")
if len(threads) != 1:
    sys.exit(f"zygote: importing torch and pyengine left {len(threads)} threads (OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS')!r}: more than 1 starts OpenBLAS's pool); forking would be unsafe")
requests, replies = os.dup(0), os.dup(1)  # the children get fresh 0/1/2: these stay the zygote's own
os.dup2(os.open(os.devnull, os.O_RDWR), 0)
os.write(replies, b"ready\n")
job, pending = None, b""
while job is None:
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
    while job is None and b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            job = request
        else:
            os.write(replies, f"started {pid}\n".encode())

# the child: a rank from here on
os.close(requests)
os.close(replies)
log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.dup2(log, 1)
os.dup2(log, 2)
os.close(log)
os.environ.clear()
os.environ.update(job["env"])
sys.argv = list(job["argv"])
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
del job, pending, request, data, ready, line
runpy.run_path(sys.argv[0], run_name="__main__")
