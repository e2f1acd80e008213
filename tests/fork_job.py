"""Run by tests/test_engine.py: an engine used in a process forked from the one that built it (Note [An engine in a
forked process] in pyengine/engine.py). usage: fork_job.py MODE close|exit|stepping. Prints what the child and the
parent saw, one line each. stepping: another thread steps while the main thread forks three children, each of which
reads the state (a mutex copied held by that thread hung the read)."""
import signal
import threading
import os
import sys
import warnings

import torch

import pyengine
from pyengine import _C

warnings.simplefilter("ignore")
mode, action = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def loss_fn(m, b):
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])


def train(engine):
    return engine.fit([batch] * 2) if mode == "async" else engine.step(batch)


batch = (torch.randn(8, 8), torch.randint(0, 3, (8,)))
engine = pyengine.Engine(model, loss_fn, devices=["cpu", "cpu"], mode=mode,
                         **(dict(stages=2, microbatches=2) if mode == "pipeline" else {}))
transfer = _C.BucketTransfer(1, "cpu", "t")
train(engine)
if action == "stepping":
    stop = threading.Event()
    stepper = threading.Thread(target=lambda: [engine.step(batch) for _ in iter(stop.is_set, True)])
    stepper.start()
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hung read ends the child (SIGALRM) instead of the test
            state = engine.state_dict()
            os._exit(0 if state["version"] == state["counters"]["steps"] >= 1 else 3)
        _, status = os.waitpid(pid, 0)
        print(f"parent: child exit {os.waitstatus_to_exitcode(status)}", flush=True)
    stop.set()
    stepper.join()
    engine.close()
    sys.exit(0)
pid = os.fork()
if pid == 0:
    for what, call in (("engine", lambda: train(engine)), ("transfer", lambda: transfer.wait(0, 0, False))):
        try:
            call()
            print(f"child: {what} ran", flush=True)
        except RuntimeError as exc:
            print(f"child: {what} refused, {'a fork of it' in str(exc)}", flush=True)
    print(f"child: state version {engine.state_dict()['version']}", flush=True)
    if action == "close":
        engine.close()
        transfer.close()
    sys.exit(0)  # the interpreter's exit, with the engine alive unless closed
_, status = os.waitpid(pid, 0)
print(f"parent: child exit {os.waitstatus_to_exitcode(status)}", flush=True)
train(engine)
print(f"parent: updates {engine.stats()['applied_updates']}", flush=True)
engine.close()
