"""The README's Python blocks run as written.

Each ```python block of README.md is run in a fresh interpreter (in a temporary folder), after a prelude that defines
the names the block takes for granted (``model``, ``x, y``, ``G``, ...) and before an epilogue that checks it did
what its comments say. A keyword the README shows that the API does not take, a default that moved, a method that was
renamed: this test fails, naming the README line. A new block needs its prelude here (the first test says so).
"""
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMMON = """
import copy, torch, pyengine
torch.manual_seed(0)
def loss_fn(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)
model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
x, y = torch.randn(64, 20), torch.randint(0, 5, (64,))
"""

# marker (a line the block holds) -> (prelude, epilogue). Each runs with _COMMON first.
BLOCKS = {
    "distributed.init_process_group(": (
        "local_batch = (x, y)\n",
        """
        stats = engine.stats()
        assert stats["steps"] == 1, stats
        engine.close()
        torch.distributed.destroy_process_group()
        """),
    'engine = pyengine.Engine(model, loss_fn, devices=["cpu"] * 4, mode="hybrid"': (
        "batches = [(x[:32], y[:32]), (x[32:], y[32:])]\n",
        """
        assert torch.isfinite(torch.tensor(metrics["loss"])), metrics
        assert engine.stats()["steps"] == 3, engine.stats()
        assert set(sd) >= {"seed"}, sorted(sd)
        import json; json.load(open("trace.json"))
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, start[n])]
        assert changed, "copy_to wrote nothing into model"
        """),
    'mode="pipeline"': (
        "inputs, targets = torch.randn(32, 784), torch.randint(0, 10, (32,))\n",
        """
        assert 0.0 <= metrics["bubble_fraction"] <= 1.0, metrics["bubble_fraction"]
        assert abs(metrics["bubble_ideal"] - 1 / 9) < 1e-9, metrics["bubble_ideal"]
        assert len(metrics["stage_sizes"]) == 2, metrics["stage_sizes"]
        engine.close()
        """),
    "store = pyengine.HostStore(": (
        """
        G, g, lo, hi = 2, 0, 3, 11
        replicas = [copy.deepcopy(model) for _ in range(G)]
        shards = [(x[:32], y[:32]), (x[32:], y[32:])]
        reference = copy.deepcopy(model)
        """,
        """
        # The hand-made step equals torch AdamW on the whole batch (the mean of the two equal shards' gradients).
        optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.0)
        loss_fn(reference, (x, y)).backward()
        optimizer.step()
        for s in streamers:  # the copies back run on each worker's copy thread (a forward would wait for them)
            s.wait_weights()
        for replica in replicas:
            for (name, a), b in zip(replica.named_parameters(), reference.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        # close() removed the hooks of the streamer it was called on (the last), and only those.
        hooks = lambda r: sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in r.parameters())
        assert streamer is streamers[-1] and hooks(replicas[-1]) == 0 and hooks(replicas[0]) > 0
        """),
    "ops.mean_grad_adamw_(param": (
        """
        N = 1000
        param, exp_avg, exp_avg_sq = torch.randn(N), torch.zeros(N), torch.zeros(N)
        g0, g1, g2, g3 = (torch.randn(N) for _ in range(4))
        before = param.clone()
        params = [torch.randn(7), torch.randn(300)]
        exp_avgs, exp_avg_sqs = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
        """,
        """
        assert not torch.equal(param, before)
        # norm is the last line's: the global norm of the workers' mean gradient over every tensor.
        mean = torch.cat([sum(grads[w][i] for w in range(3)) / 3 for i in range(len(params))])
        torch.testing.assert_close(norm, torch.linalg.vector_norm(mean), rtol=1e-5, atol=0)
        assert not bool(nonfinite)
        """),
}


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of every ```python block of README.md."""
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


def marker_of(code: str) -> str | None:
    found = [marker for marker in BLOCKS if marker in code]
    return found[0] if len(found) == 1 else None


def test_every_block_has_a_prelude():
    blocks = python_blocks()
    assert blocks, "README.md has no ```python block"
    missing = [line for line, code in blocks if marker_of(code) is None]
    assert not missing, (f"README.md's python blocks at lines {missing} match no entry (or several) of BLOCKS in "
                         "tests/test_readme.py: give each a prelude there")
    used = {marker_of(code) for _, code in python_blocks()}
    assert used == set(BLOCKS), f"BLOCKS entries matching no README block: {sorted(set(BLOCKS) - used)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("line,code", python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_block_runs(line, code, tmp_path):
    marker = marker_of(code)
    assert marker is not None, f"README.md line {line}: no prelude (see test_every_block_has_a_prelude)"
    prelude, epilogue = BLOCKS[marker]
    script = "\n".join([_COMMON, textwrap.dedent(prelude),
                        "start = {n: p.detach().clone() for n, p in model.named_parameters()}",
                        "# ---- README.md line %d ----" % line, code, "# ---- checks ----", textwrap.dedent(epilogue)])
    path = tmp_path / "block.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    result = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (f"README.md's python block at line {line} failed:\n{result.stderr[-4000:]}\n"
                                    f"(the script: {path})")


# Keywords the README passes on purpose with a value other than the default (the rest show the defaults).
_NOT_DEFAULTS = {("pyengine.Engine", "mode"), ("pyengine.Engine", "stages"), ("pyengine.Engine", "microbatches"),
                 ("ops.mean_grad_adamw_multi_", "max_grad_norm")}


def test_shown_keywords_are_the_defaults():
    """Where the README writes ``keyword=literal`` in a call of the public API, the literal is the default (unless
    listed in _NOT_DEFAULTS): the blocks double as the reference of every default."""
    import ast
    import inspect

    import pyengine
    from pyengine import distributed, ops
    api = {"pyengine.Engine": pyengine.Engine, "pyengine.AdamW": pyengine.AdamW, "pyengine.HostStore": pyengine.HostStore,
           "pyengine.GradientStreamer": pyengine.GradientStreamer, "pyengine.pipelined_update": pyengine.pipelined_update,
           "ops.mean_grad_adamw_": ops.mean_grad_adamw_, "ops.mean_grad_adamw_clipped_": ops.mean_grad_adamw_clipped_,
           "ops.mean_grad_adamw_multi_": ops.mean_grad_adamw_multi_, "ops.mean_grad_norm": ops.mean_grad_norm,
           "distributed.init_process_group": distributed.init_process_group}
    wrong, checked = [], 0
    for line, code in python_blocks():
        for node in ast.walk(ast.parse(code)):
            name = ast.unparse(node.func) if isinstance(node, ast.Call) else None
            if name not in api:
                continue
            parameters = inspect.signature(api[name]).parameters
            for keyword in node.keywords:
                parameter = parameters.get(keyword.arg)
                if parameter is None:
                    assert any(p.kind is p.VAR_KEYWORD for p in parameters.values()), (line, name, keyword.arg)
                    continue
                if parameter.default is parameter.empty or (name, keyword.arg) in _NOT_DEFAULTS:
                    continue
                try:
                    shown = ast.literal_eval(keyword.value)
                except ValueError:
                    continue  # an expression (devices=["cpu"] * 4, a model): an example, not a default
                checked += 1
                if shown != parameter.default or isinstance(shown, bool) != isinstance(parameter.default, bool):
                    wrong.append(f"README.md line ~{line}: {name}({keyword.arg}={shown!r}) but the default is "
                                 f"{parameter.default!r}")
    assert checked >= 30, checked
    assert not wrong, "\n".join(wrong)


# Flags of other programs the README shows: torchrun's, pip's, setup.py's, pytest-benchmark's.
_OTHER_PROGRAMS_FLAGS = {"--nnodes", "--nproc-per-node", "--standalone", "--rdzv-backend", "--rdzv-endpoint",
                         "--no-build-isolation", "--inplace", "--benchmark-only"}


def test_every_flag_shown_exists():
    """Each ``--flag`` the README names is an option of ``python -m pyengine`` (train or plan), of a script in bench/,
    or of one of the few other programs it shows (_OTHER_PROGRAMS_FLAGS)."""
    import argparse
    import glob

    from pyengine import cli
    known = set(_OTHER_PROGRAMS_FLAGS)
    for action in cli.build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                known.update(s for a in sub._actions for s in a.option_strings)
    for script in glob.glob(os.path.join(ROOT, "bench", "*.py")) + glob.glob(os.path.join(ROOT, "bench", "*.sh")):
        known.update(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", open(script).read()))
    shown = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", open(os.path.join(ROOT, "README.md")).read()))
    assert {"--mode", "--resume", "--trace"} <= shown
    assert not shown - known, f"README.md names options that nothing defines: {sorted(shown - known)}"
