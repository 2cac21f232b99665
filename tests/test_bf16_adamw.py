"""AdamW over bf16 weights with float32 moments and stochastic rounding (train/bf16_adamw.py)."""

import pytest
import torch

from fastddrive.train.bf16_adamw import BF16AdamW, stochastic_round_to_bf16


def _pair(n: int = 4096, seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    start = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return torch.nn.Parameter(start.float()), torch.nn.Parameter(start.clone())


def test_each_step_lands_on_a_bf16_neighbour_of_torchs_float32_adamw_step():
    """From the same weights and gradients, one step lands on one of the two bf16 values around torch's float32
    AdamW result; over three steps the weights stay within a few bf16 ulps of it."""
    reference, weights = _pair()
    torch_adamw = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.01)
    ours = BF16AdamW([weights], lr=1e-2, weight_decay=0.01)
    for step in range(3):
        grad = torch.randn(4096, generator=torch.Generator().manual_seed(100 + step)).to(torch.bfloat16)
        reference.grad, weights.grad = grad.float(), grad
        before = weights.detach().float().clone()
        torch_adamw.step()
        ours.step()
        if step == 0:
            exact = reference.detach()
            low = exact.to(torch.bfloat16).float()
            ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp(min=1e-30)
            assert (before != weights.detach().float()).float().mean() > 0.9  # the step moved the weights
            assert ((weights.detach().float() - exact).abs() <= ulp * 1.001).all()
            assert ((weights.detach().float() - low).abs() <= ulp * 1.001).all()
    drift = (weights.detach().float() - reference.detach()).abs() / reference.detach().abs().clamp(min=1e-3)
    assert drift.max() < 4 * torch.finfo(torch.bfloat16).eps


def test_updates_below_half_a_bf16_ulp_still_move_the_weights_on_average():
    """lr 1e-4 on weights of 1 (a bf16 ulp there is 2^-7): rounding to nearest would never move them; stochastic
    rounding keeps their mean on the float32 trajectory."""
    weights = torch.nn.Parameter(torch.ones(200_000, dtype=torch.bfloat16))
    optimizer = BF16AdamW([weights], lr=1e-4, weight_decay=0.0)
    for _ in range(20):
        weights.grad = torch.ones_like(weights)
        optimizer.step()
    assert torch.tensor(1.0 - 1e-4).to(torch.bfloat16) == 1.0  # to nearest, one update is lost
    assert abs(weights.detach().float().mean().item() - (1.0 - 20 * 1e-4)) < 2e-5


def test_a_reloaded_optimizer_keeps_float32_moments_and_continues_bit_for_bit():
    first = torch.nn.Parameter(torch.randn(512).to(torch.bfloat16))
    optimizer = BF16AdamW([first], lr=1e-3, weight_decay=0.01, seed=3)
    grads = [torch.randn(512, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16) for k in range(4)]
    for grad in grads[:2]:
        first.grad = grad
        optimizer.step()
    second = torch.nn.Parameter(first.detach().clone())
    reloaded = BF16AdamW([second], lr=1e-3, weight_decay=0.01, seed=3)
    reloaded.load_state_dict(optimizer.state_dict())
    assert reloaded.state[second]["exp_avg"].dtype == torch.float32  # torch would have cast it to bf16
    assert torch.equal(reloaded.state[second]["exp_avg_sq"], optimizer.state[first]["exp_avg_sq"])
    for grad in grads[2:]:
        first.grad, second.grad = grad, grad.clone()
        optimizer.step()
        reloaded.step()
    assert torch.equal(first, second)


def test_stochastic_rounding_keeps_bf16_values_and_picks_a_neighbour_otherwise():
    exact = torch.randn(1000).abs().add(0.01).to(torch.bfloat16).float()
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(stochastic_round_to_bf16(exact, generator).float(), exact)
    up = torch.nextafter(exact.to(torch.bfloat16), torch.tensor(float("inf"), dtype=torch.bfloat16)).float()
    between = exact + (up - exact) / 3  # a third of the way to the bf16 value above
    rounded = stochastic_round_to_bf16(between, generator).float()
    assert ((rounded == exact) | (rounded == up)).all()
    assert 0.28 < (rounded == up).float().mean() < 0.39  # up about a third of the time (1000 draws)


def test_float32_weights_are_refused():
    weights = torch.nn.Parameter(torch.ones(4))
    weights.grad = torch.ones(4)
    with pytest.raises(TypeError, match="bfloat16"):
        BF16AdamW([weights], lr=1e-3, weight_decay=0.0).step()
