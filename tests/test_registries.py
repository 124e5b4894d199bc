"""Open registries: a loss and an advantage estimator defined here, in user code, train end to end."""

import pytest
import torch
from helpers import distinct_tokens, numbered_prompts

from grouprl import GRPOConfig, GRPOTrainer, register_advantage, register_loss
from grouprl.core.advantages import ADVANTAGE_ESTIMATORS, estimate_advantages
from grouprl.core.loss_aggregations import global_token_mean_aggregation
from grouprl.core.losses import LOSSES, policy_loss

SEEN = {"scales": [], "advantage_calls": 0}


def scaled_reinforce(logprobs, log_ratio, log_weights, advantages, mask, *, scale, **_):
    """REINFORCE with a hyper-parameter: -scale * A * log pi per token."""
    SEEN["scales"].append(scale)
    return -scale * advantages * logprobs, {}


def centred_ranks(rewards_per_function, weights, *, group_size, **_):
    """Each completion's rank within its group, centred: a scale-free advantage."""
    SEEN["advantage_calls"] += 1
    total = (rewards_per_function.nan_to_num(0.0) * weights).sum(dim=1).view(-1, group_size)
    ranks = total.argsort(dim=1).argsort(dim=1).float()
    return (ranks - ranks.mean(dim=1, keepdim=True)).view(-1)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_loss(
        "scaled_reinforce",
        scaled_reinforce,
        global_token_mean_aggregation,
        params={"scale": 1.0},
        divides_by_grad_accum=False,
    )
    register_advantage("centred_ranks", centred_ranks)
    yield
    LOSSES.pop("scaled_reinforce")
    ADVANTAGE_ESTIMATORS.pop("centred_ranks")


def test_a_registered_loss_and_estimator_train_end_to_end(tiny_model_dir, tmp_path):
    SEEN["scales"].clear()
    calls_before = SEEN["advantage_calls"]
    config = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=6,
        learning_rate=0.05,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        loss_type="scaled_reinforce",
        loss_kwargs={"scale": 2.5},
        advantage_estimator="centred_ranks",
    )
    trainer = GRPOTrainer(tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts(12))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert SEEN["scales"] and set(SEEN["scales"]) == {2.5}
    assert SEEN["advantage_calls"] - calls_before == 2  # one generation per step
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_registered_loss_value_follows_its_formula():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -4.0]])
    mask = torch.tensor([[True, True], [True, False]])
    advantages = torch.tensor([1.0, -2.0])
    loss, _ = policy_loss(
        "scaled_reinforce",
        logprobs,
        None,
        advantages,
        mask,
        epsilon_low=0.2,
        epsilon_high=0.2,
        grad_accum_steps=1,
        max_completion_length=2,
        token_denominator=3.0,
        loss_params={"scale": 2.0},
    )
    # -2 * (1*-1 + 1*-2 + -2*-0.5) / 3 tokens = -2 * (-2) / 3
    assert loss.item() == pytest.approx(4.0 / 3.0)


def test_registered_estimator_values_and_unscorable_rows():
    rewards = torch.tensor([[1.0], [3.0], [2.0], [float("nan")], [5.0], [4.0]])
    advantages, stats = estimate_advantages("centred_ranks", rewards, torch.ones(1), group_size=3)
    assert advantages.tolist() == [-1.0, 1.0, 0.0, 0.0, 1.0, 0.0]  # the unscorable row gets 0
    assert torch.equal(stats["unscorable"], torch.tensor([False, False, False, True, False, False]))


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="loss_type='nope' is not one of .*register_loss"):
        GRPOConfig(loss_type="nope")
    with pytest.raises(
        ValueError, match="loss_kwargs: loss_type='scaled_reinforce' has no hyper-parameter 'temp'.*'scale'"
    ):
        GRPOConfig(loss_type="scaled_reinforce", loss_kwargs={"temp": 1.0})
    with pytest.raises(ValueError, match="advantage_estimator='nope' is not one of .*register_advantage"):
        GRPOConfig(advantage_estimator="nope")
    with pytest.raises(ValueError, match="exists already; pass replace=True"):
        register_loss("dapo", scaled_reinforce, global_token_mean_aggregation)
    with pytest.raises(ValueError, match="returned .*must return a tensor of shape"):
        register_advantage("bad_shape", lambda r, w, **_: r[:1, 0])
        try:
            estimate_advantages("bad_shape", torch.ones(4, 1), torch.ones(1), group_size=2)
        finally:
            ADVANTAGE_ESTIMATORS.pop("bad_shape")


def test_replacing_the_builtin_grpo_estimator_is_honoured():
    """ "grpo" is an ordinary registry entry: replaced with register_advantage(..., replace=True), the replacement
    computes the advantages (the built-in is restored afterwards)."""
    rewards = torch.tensor([[1.0], [0.0], [3.0], [2.0]])
    weights = torch.ones(1)
    builtin = ADVANTAGE_ESTIMATORS["grpo"]
    standard, _ = estimate_advantages("grpo", rewards, weights, group_size=2)
    try:
        register_advantage("grpo", centred_ranks, replace=True)
        replaced, _ = estimate_advantages("grpo", rewards, weights, group_size=2)
    finally:
        register_advantage("grpo", builtin, replace=True)
    assert replaced.tolist() == [0.5, -0.5, 0.5, -0.5]  # centred ranks, not group-normalised rewards
    assert not torch.allclose(standard, replaced)
    assert torch.equal(estimate_advantages("grpo", rewards, weights, group_size=2)[0], standard)
