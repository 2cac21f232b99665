"""Lockstep rollouts (`decode.lockstep`): rows that verify guessed windows together commit exactly what each
row's AR sampler draws, whatever the guesses, and take fewer forwards the better the guesses are."""

import numpy as np
import pytest

from fastddrive.decode import decode, tts
from fastddrive.decode.acceptance import accept
from fastddrive.decode.lockstep import lockstep_rollouts
from fastddrive.decode.meter import ForwardMeter
from fastddrive.decode.state import Canvas, row_picker
from model_fixtures import peaky_case

SEEDS = [3, 4, 5]
TEMPERATURE = 1.5


@pytest.fixture(scope="module", params=[("qwen2", 0), ("qwen2.5-vl", 2)])
def case(request):
    """A peaky random model and, for every seed, `ar`'s samples with it: the rows' references."""
    model, prompt, scaffold = peaky_case(*request.param)
    references = [decode("ar", model, prompt, scaffold, temperature=TEMPERATURE, seed=s).token_ids for s in SEEDS]
    assert len({tuple(r) for r in references}) == len(SEEDS)  # the rows differ, so equality means something
    return model, prompt, scaffold, references


def lockstep(model, prompt, scaffold, window, guesses=None) -> tuple[list[list[int]], int]:
    """The rows' ids and the forwards they took, from the prompt's end."""
    canvas = Canvas.prefill(model, prompt, scaffold)
    forks = tts.fork_rollouts(model, canvas, len(SEEDS))
    meter = ForwardMeter()
    with meter.watch(model):
        lockstep_rollouts(model, forks, row_picker(TEMPERATURE, SEEDS, len(scaffold)), window, guesses)
    assert len({f.committed for f in forks}) == len({f.cached for f in forks}) == 1  # the rows moved together
    return [f.ids for f in forks], meter.calls


def corrupted(reference: list[int], rate: float, vocab: int, seed: int) -> list[int]:
    """`reference` with each position replaced by another token with probability `rate`."""
    rng = np.random.default_rng(seed)
    return [int((t + rng.integers(1, vocab)) % vocab) if rng.random() < rate else t for t in reference]


@pytest.mark.parametrize("window", [1, 4, 24])
@pytest.mark.parametrize("rate", [0.0, 0.05, 0.2, 0.5, None])
def test_lockstep_rows_commit_what_each_rows_ar_sampler_draws(case, window, rate):
    """Guesses of every quality (oracle, corrupted, or the template's |<MASK>|s when `rate` is None) give
    every row exactly `ar`'s samples with its seed; oracle guesses are accepted window by window."""
    model, prompt, scaffold, references = case
    vocab = model.core.config.get_text_config().vocab_size
    guesses = None if rate is None else [corrupted(r, rate, vocab, s) for r, s in zip(references, SEEDS, strict=True)]
    ids, forwards = lockstep(model, prompt, scaffold, window, guesses)
    assert ids == references
    length, values = len(scaffold), int(scaffold.is_value.sum())
    if rate == 0.0:  # the prefill's logits commit position 0; every forward then takes its window and one more
        assert forwards == -(-(length - 1) // (window + 1))
    if window == 24:
        perfect = -(-(length - 1) // 25)
        assert forwards <= values  # never more than one forward per value, as jump-forward AR
        if rate is not None and rate >= 0.2:
            assert forwards > perfect  # the corruption was met, and cost forwards


def test_agreement_counts_the_leading_guesses_the_verifier_confirms():
    assert accept([5, 6, 9], [5, 6, 7, 8]).agreed == 2
    assert accept([5, 6, 7], [5, 6, 7, 8]).agreed == 3  # the token after the guesses is not a guess
    assert accept([2], [1]).agreed == 0


def test_a_window_below_one_is_refused(case):
    model, prompt, scaffold, _ = case
    canvas = Canvas.prefill(model, prompt, scaffold)
    with pytest.raises(ValueError, match="window must be >= 1"):
        lockstep_rollouts(model, [canvas], row_picker(TEMPERATURE, [0], len(scaffold)), 0)
