"""pyengine.rng: a concurrent worker's random modules draw from its own generator (Note [Random numbers of concurrent
workers]); the default generator is left exactly as it was."""
import threading

import torch

from pyengine.rng import WorkerRNG, worker_seed


def routed_model(rng):
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.RReLU(),
                                torch.nn.AlphaDropout(0.0), torch.nn.Linear(32, 4))
    assert rng.install(model) == 3  # the dropouts and RReLU; Linear draws nothing
    return model


def test_routed_draws_leave_the_default_generator_alone_and_follow_the_seed():
    x = torch.randn(16, 8)
    torch.manual_seed(1)
    before = torch.get_rng_state()
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = routed_model(WorkerRNG(torch.device("cpu"), seed=5, worker=1))
        torch.set_rng_state(before)
        outs.append([model(x) for _ in range(3)])
        assert torch.equal(torch.get_rng_state(), before), "the default generator must not move"
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0][0], outs[0][1]), "each call draws new masks"


def test_workers_draw_the_same_masks_whatever_the_thread_timing():
    """Two workers in threads, each with its own generator: the masks of worker g depend on (seed, g) only."""
    x = torch.randn(64, 8)

    def run(order):
        torch.manual_seed(0)
        models = [routed_model(WorkerRNG(torch.device("cpu"), 3, g)) for g in range(2)]
        results = [None, None]

        def work(g):
            results[g] = [models[g](x) for _ in range(20)]
        threads = [threading.Thread(target=work, args=(g,)) for g in order]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results
    first, second = run([0, 1]), run([1, 0])
    for g in range(2):
        for a, b in zip(first[g], second[g]):
            assert torch.equal(a, b)
    assert not torch.equal(first[0][0], first[1][0]), "workers draw different masks"


def test_eval_mode_and_p_zero_draw_nothing():
    rng = WorkerRNG(torch.device("cpu"), 0, 0)
    model = routed_model(rng).eval()
    state = rng.get_state()
    model(torch.randn(4, 8))
    assert torch.equal(rng.get_state(), state)
    assert worker_seed(0, 0) != worker_seed(0, 1) and worker_seed(1, 0) != worker_seed(0, 0)
