"""The embedded datasets (pyengine.data) and the CLI's models (pyengine.models): argument checks of the API."""
import re

import pytest
import torch

from pyengine import data, models


@pytest.fixture(scope="module")
def digits():
    return data.load("digits")


@pytest.fixture(scope="module")
def tokens():
    return data.synthetic_tokens(train=16, test=8, seq_len=8, vocab=16)


@pytest.mark.parametrize("args,error,message", [
    ((0, 10_000, 0), ValueError, "batch_size must be at most the digits training split's 1437 samples .*; got 10000"),
    ((0, 1438, 0), ValueError, "batch_size must be at most .*; got 1438"),
    ((0, 0, 0), ValueError, "batch_size must be an integer >= 1; got 0"),
    ((0, -4, 0), ValueError, "batch_size must be an integer >= 1; got -4"),
    ((0, 32.0, 0), TypeError, "batch_size must be an integer >= 1; got float 32.0"),
    ((-1, 64, 0), ValueError, "step must be an integer >= 0; got -1"),
    ((1.5, 64, 0), TypeError, "step must be an integer >= 0; got float 1.5"),
    ((0, 64, None), TypeError, r"seed must be an integer in \[0, 18446744073709551616\); got NoneType None"),
    ((0, 64, 1.5), TypeError, "seed must be an integer .*; got float 1.5"),
    ((0, 64, True), TypeError, "seed must be an integer .*; got bool True"),
    ((0, 64, -1), ValueError, "seed must be an integer .*; got -1"),
    ((0, 64, 2**64), ValueError, "seed must be an integer .*; got 18446744073709551616"),
])
def test_batch_refuses_a_batch_size_or_step_out_of_range(digits, args, error, message):
    """A batch larger than the split (or 0) once divided by zero; step -1 gave a batch of the last epoch's end."""
    with pytest.raises(error, match=message):
        digits.batch(*args)


def test_batch_and_stream_at_the_edges(digits):
    x, y = digits.batch(0, digits.train_size, 3)  # the whole split is one batch
    assert x.shape[0] == digits.train_size and sorted(y.tolist()) == sorted(digits.y_train.tolist())
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1; got 0"):
        digits.steps_per_epoch(0)
    assert digits.steps_per_epoch(digits.train_size + 1) == 0  # the CLI's "no full batch" check reads this
    taken = []
    stream = digits.stream(5, 64, 1, skip={6}, indices=taken)
    for expected in (5, 7):
        assert torch.equal(next(stream)[0], digits.batch(expected, 64, 1)[0])
    assert taken == [5, 7]


@pytest.mark.parametrize("args,error,message", [
    ((-1, 64, 0), ValueError, "start must be an integer >= 0; got -1"),
    (("0", 64, 0), TypeError, "start must be an integer >= 0; got str '0'"),
    ((0, 0, 0), ValueError, "batch_size must be an integer >= 1; got 0"),
    ((0, 10_000, 0), ValueError, "batch_size must be at most"),
    ((0, 64, None), TypeError, "seed must be an integer .*; got NoneType None"),
    ((0, 64, "3"), TypeError, "seed must be an integer .*; got str '3'"),
    ((0, 64, 0, None), TypeError, "stream: skip must be a set of steps; got NoneType None"),
    ((0, 64, 0, 5), TypeError, "stream: skip must be a set of steps; got int 5"),
    ((0, 64, 0, set(), ()), TypeError, r"stream: indices must be a list .*; got tuple \(\)"),
])
def test_stream_checks_its_arguments_when_called(digits, args, error, message):
    """A negative start once streamed the batches of "steps" -1, 0, ...; the checks run at the call, not at the
    first batch."""
    with pytest.raises(error, match=message):
        digits.stream(*args)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(train=-1), ValueError, "synthetic_tokens: train must be an integer >= 1; got -1"),
    (dict(train=0), ValueError, "synthetic_tokens: train must be an integer >= 1; got 0"),
    (dict(test=0), ValueError, "synthetic_tokens: test must be an integer >= 1; got 0"),
    (dict(seq_len=0), ValueError, "synthetic_tokens: seq_len must be an integer >= 1; got 0"),
    (dict(vocab=0), ValueError, "synthetic_tokens: vocab must be an integer >= 1; got 0"),
    (dict(vocab=16.0), TypeError, "synthetic_tokens: vocab must be an integer >= 1; got float 16.0"),
    (dict(p_follow=1.5), ValueError, r"synthetic_tokens: p_follow must be a probability in \[0, 1\]; got 1.5"),
    (dict(p_follow=-0.1), ValueError, r"synthetic_tokens: p_follow must be a probability in \[0, 1\]; got -0.1"),
    (dict(p_follow=float("nan")), ValueError, "p_follow must be a probability .*; got nan"),
    (dict(p_follow="0.8"), TypeError, "p_follow must be a probability .*; got str '0.8'"),
])
def test_synthetic_tokens_refuses_sizes_below_one_and_a_probability_outside_0_1(kwargs, error, message):
    """train=-1 once gave a split of 6 and 1 sequences whose info said train=-1; p_follow=1.5 was recorded as
    given; vocab=0 failed inside torch."""
    with pytest.raises(error, match=message):
        data.synthetic_tokens(**{"train": 8, "test": 8, "seq_len": 4, "vocab": 8, **kwargs})


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(split_seed=None), TypeError, r"load_digits: split_seed must be an integer in \[0, 4294967296\); got "
                                       "NoneType None"),
    (dict(split_seed=-1), ValueError, "split_seed must be an integer .*; got -1"),
    (dict(split_seed=2**32), ValueError, "split_seed must be an integer .*; got 4294967296"),
    (dict(split_seed=1.0), TypeError, "split_seed must be an integer .*; got float 1.0"),
    (dict(test_fraction=100), ValueError, r"test_fraction must be a fraction in \(0, 1\); got 100"),
    (dict(test_fraction=0), ValueError, r"test_fraction must be a fraction in \(0, 1\); got 0"),
    (dict(test_fraction=1.0), ValueError, r"test_fraction must be a fraction in \(0, 1\); got 1.0"),
    (dict(test_fraction="0.2"), TypeError, r"test_fraction must be a fraction in \(0, 1\) \(not a count\); got str"),
    (dict(test_fraction=0.001), ValueError, "test_fraction 0.001 holds out 2 of 1797 samples; a split by class needs "
                                            "at least 10"),
    (dict(test_fraction=0.999), ValueError, "holds out 1796 of 1797 samples"),
])
def test_load_digits_refuses_a_split_seed_or_test_fraction_it_cannot_use(kwargs, error, message):
    """split_seed=None gave a different split at each load; test_fraction=100 was read as a count of samples;
    a fraction leaving fewer samples than classes failed inside scikit-learn."""
    with pytest.raises(error, match=message):
        data.load("digits", **kwargs)


@pytest.mark.parametrize("seed,error", [(None, TypeError), (1.5, TypeError), (-1, ValueError), (2**32, ValueError)])
def test_synthetic_tokens_refuses_a_seed_out_of_range(seed, error):
    with pytest.raises(error, match="synthetic_tokens: seed must be an integer in"):
        data.load("tokens", split_seed=seed, train=4, test=2, seq_len=3, vocab=5)


def test_synthetic_tokens_at_the_edges():
    one = data.synthetic_tokens(train=1, test=1, seq_len=1, vocab=1, p_follow=0)
    assert one.x_train.shape == (1, 1) and one.x_test.shape == (1, 1)
    always = data.synthetic_tokens(train=4, test=1, seq_len=6, vocab=8, p_follow=1)
    assert len({(a, b) for a, b in zip(always.x_train.flatten().tolist(), always.y_train.flatten().tolist())}) <= 8


@pytest.mark.parametrize("name,kwargs,message", [
    ("tokens", dict(seed=1), "load: no seed argument .*split_seed.*; got seed=1"),
    ("digits", dict(seed=0), "load: no seed argument"),
    ("digits", dict(train=10, vocab=3), r"load\('digits'\): unexpected argument\(s\) train, vocab; digits takes "
                                        "split_seed and test_fraction"),
    ("tokens", dict(test_fraction=0.5), r"load\('tokens'\): test_fraction does not apply .*; got test_fraction=0.5"),
    ("tokens", dict(classes=3), r"load\('tokens'\): unexpected argument\(s\) classes; tokens takes split_seed and "
                                "train, test, seq_len, vocab, p_follow"),
])
def test_load_refuses_an_argument_the_dataset_does_not_use(name, kwargs, message):
    """load once took a seed it never used (two seeds, the same tokens), dropped digits' other arguments and the
    tokens' test_fraction without a word."""
    with pytest.raises(TypeError, match=message):
        data.load(name, **kwargs)


def test_load_passes_on_what_each_dataset_uses():
    small = data.load("tokens", split_seed=1, train=8, test=4, seq_len=5, vocab=7)
    assert small.x_train.shape == (8, 5) and small.x_test.shape == (4, 5) and small.info["vocab"] == 7
    assert not torch.equal(small.x_train, data.load("tokens", split_seed=2, train=8, test=4, seq_len=5,
                                                    vocab=7).x_train)
    half = data.load("digits", test_fraction=0.5)
    assert half.x_test.shape[0] in (898, 899) and data.load("digits").x_test.shape[0] == 360
    assert data.load("digits", test_fraction=0.006).x_test.shape[0] == 11  # near the smallest split by class
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        data.load("mnist")


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_gives_the_model_back_in_its_mode(digits, training):
    """It always came back in training mode: a model the caller had put in eval mode then ran its dropout and
    batch statistics as in training."""
    model = models.build("mlp", digits, 0, hidden=8).train(training)
    models.evaluate(model, digits.x_test, digits.y_test)
    assert model.training is training


def test_evaluate_refuses_an_empty_set_and_a_batch_size_below_one(digits):
    """An empty set once divided by zero; batch_size 0 failed inside range()."""
    model = models.build("mlp", digits, 0, hidden=8)
    with pytest.raises(ValueError, match=r"evaluate: the evaluation set is empty \(x of shape \(0, 64\), y of shape "
                                         r"\(0,\)\); expected at least one sample"):
        models.evaluate(model, digits.x_test[:0], digits.y_test[:0])
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"evaluate: batch_size must be an integer >= 1; got {bad}"):
            models.evaluate(model, digits.x_test, digits.y_test, batch_size=bad)
    with pytest.raises(ValueError, match=r"evaluate: x and y must hold the same samples; got x of shape \(4, 64\) "
                                         r"and y of shape \(10,\)"):
        models.evaluate(model, digits.x_test[:4], digits.y_test[:10])  # scored against the first 4 labels
    whole = models.evaluate(model, digits.x_test, digits.y_test)
    one_by_one = models.evaluate(model, digits.x_test[:3], digits.y_test[:3], batch_size=1)
    assert 0 <= whole["test_accuracy"] <= 1 and one_by_one["test_loss"] > 0


@pytest.mark.parametrize("hidden", [0, -8, 8.0, True])
def test_build_refuses_a_width_below_one(digits, tokens, hidden):
    """hidden=0 once built the default width 256 (``hidden or 256``)."""
    for name, dataset in (("mlp", digits), ("transformer", tokens)):
        with pytest.raises(ValueError, match=r"build: hidden must be None \(the model's default width\) or an integer "
                                             f">= 1; got {hidden!r}"):
            models.build(name, dataset, 0, hidden)
    assert models.build("mlp", digits, 0).net[0].out_features == 256
    assert models.build("mlp", digits, 0, 1).net[0].out_features == 1
    assert models.build("transformer", tokens, 0).tok.embedding_dim == 128


def test_build_refuses_a_transformer_width_its_heads_do_not_divide_and_a_seed_that_is_no_int(digits, tokens):
    """hidden=130 failed inside torch's attention ("embed_dim must be divisible by num_heads"); seed="0" was taken
    by torch.manual_seed."""
    with pytest.raises(ValueError, match=f"build: the transformer's hidden width must be a multiple of its "
                                         f"{models.TRANSFORMER_HEADS} attention heads; got 130"):
        models.build("transformer", tokens, 0, hidden=130)
    assert models.build("transformer", tokens, 0, hidden=4 * models.TRANSFORMER_HEADS).tok.embedding_dim == 16
    for seed in ("0", 1.0, True, None):
        with pytest.raises(TypeError, match="build: seed must be an int; got"):
            models.build("mlp", digits, seed, hidden=8)


@pytest.mark.parametrize("make,message", [
    (lambda: models.MLP(depth=-1), "MLP: depth must be an int >= 0; got -1"),
    (lambda: models.MLP(d_in=0), "MLP: d_in must be an int >= 1; got 0"),
    (lambda: models.MLP(hidden=2.5), "MLP: hidden must be an int >= 1; got 2.5"),
    (lambda: models.TinyTransformer(vocab=0), "TinyTransformer: vocab must be an int >= 1; got 0"),
    (lambda: models.TinyTransformer(d=30, heads=4), "TinyTransformer: d must be a multiple of heads; got d=30"),
    (lambda: models.TinyTransformer(layers=True), "TinyTransformer: layers must be an int >= 0; got True"),
])
def test_model_sizes_are_checked(make, message):
    """MLP(depth=-1) built a depth-0 model and MLP(d_in=0) one of no inputs, without a word."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make()
    assert len(models.MLP(depth=0).net) == 1 and len(models.TinyTransformer(layers=0, d=8).blocks) == 0


def test_build_refuses_a_dataset_of_another_task(digits, tokens):
    """An MLP on the tokens once failed with KeyError: 'features' (a transformer on digits with KeyError: 'vocab')."""
    with pytest.raises(ValueError, match="build: model 'mlp' needs a dataset of task 'classify'; got 'tokens' of "
                                         "task 'lm'"):
        models.build("mlp", tokens, 0)
    with pytest.raises(ValueError, match="build: model 'transformer' needs a dataset of task 'lm'; got 'digits' of "
                                         "task 'classify'"):
        models.build("transformer", digits, 0)
    with pytest.raises(ValueError, match="unknown model 'cnn'"):
        models.build("cnn", digits, 0)


def test_seeds_that_differ_above_bit_32_shuffle_and_initialise_apart():
    """torch's CPU generator keeps the low 32 bits of its seed: --seed 1 and 1 + 2**32 gave the same batches in every
    epoch and the same initial model. Seeds below 2**32 keep their orders and models."""
    digits = data.load("digits")
    per_epoch = digits.steps_per_epoch(32)
    for seed in (1, 5):
        for step in (0, per_epoch, 3 * per_epoch + 2):
            assert not torch.equal(digits.batch(step, 32, seed)[0], digits.batch(step, 32, seed + 2**32)[0])
        first, twin = models.build("mlp", digits, seed, 8), models.build("mlp", digits, seed + 2**32, 8)
        assert not torch.equal(first.net[0].weight, twin.net[0].weight)
    built = models.build("mlp", digits, 5, 8)
    torch.manual_seed(5)  # the model a small seed always had
    assert torch.equal(built.net[0].weight, torch.nn.Linear(64, 8).weight)


def test_seeds_in_the_upper_half_of_their_range_order_the_data_their_own_way():
    """--seed takes [0, 2**64): the shuffle's generator seed was taken modulo 2**63 - 1, so s and s + 2**63 - 1 gave
    the same batches in every epoch. Small seeds keep the order they always had (their mixed seed is below both)."""
    digits = data.load("digits")
    per_epoch = digits.steps_per_epoch(32)
    for seed in (0, 1, 12345):
        twin = seed + 2**63 - 1
        for step in (0, per_epoch, 5 * per_epoch + 3):
            assert not torch.equal(digits.batch(step, 32, seed)[1], digits.batch(step, 32, twin)[1]) or \
                not torch.equal(digits.batch(step, 32, seed)[0], digits.batch(step, 32, twin)[0]), (seed, step)
    # the order a small seed always had: epoch 2's shuffle, from its generator seed as before
    order = torch.randperm(digits.train_size, generator=torch.Generator().manual_seed(7 * 1_000_003 + 2 * 7919 + 12345))
    assert torch.equal(digits.batch(2 * per_epoch, 32, 7)[0], digits.x_train[order[:32]])
