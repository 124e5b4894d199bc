"""Open registries: a loss and an advantage estimator defined here, in user code, train end to end."""

import inspect

import pytest
import torch
from helpers import distinct_tokens, numbered_prompts, quiet_config

from grouprl import GRPOConfig, GRPOTrainer, register_advantage, register_loss
from grouprl.core.advantages import ADVANTAGE_ESTIMATORS, estimate_advantages
from grouprl.core.losses import LOSSES, LossScale, LossSpec, global_token_mean_aggregation, policy_loss

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
        scale=LossScale(grad_accum_steps=1, max_completion_length=2, token_denominator=3.0),
        settings={"scale": 2.0},
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


def test_policy_loss_takes_only_what_every_loss_shares():
    """A loss's own hyper-parameters travel in `settings`; policy_loss has no keyword per loss."""
    assert len(inspect.signature(policy_loss).parameters) <= 10
    with pytest.raises(ValueError, match="loss_type 'sapo' has no hyper-parameter 'epsilon_low'"):
        policy_loss(
            "sapo",
            torch.zeros(1, 1),
            None,
            torch.ones(1),
            torch.ones(1, 1, dtype=torch.bool),
            scale=LossScale(1, 1, 1.0),
            settings={"epsilon_low": 0.2},
        )


def test_builtin_losses_are_registry_entries_filled_from_their_trl_fields():
    """Each built-in loss is a LossSpec like a user's; its settings are the TRL fields a user sets, by their
    TRL names, and loss_kwargs cannot set them a second way."""
    assert all(isinstance(spec, LossSpec) for spec in LOSSES.values())
    default = GRPOConfig()
    assert all(LOSSES[name].settings(default) == LOSSES[name].params for name in ("grpo", "cispo", "sapo", "vespo"))
    config = GRPOConfig(loss_type="grpo", epsilon=0.3, delta=1.5)
    assert LOSSES["grpo"].settings(config) == {"epsilon_low": 0.3, "epsilon_high": 0.3, "delta": 1.5}
    config = GRPOConfig(loss_type="dapo", epsilon_high=0.28)
    assert LOSSES["dapo"].settings(config) == {"epsilon_low": 0.2, "epsilon_high": 0.28, "delta": None}
    config = GRPOConfig(loss_type="cispo", epsilon_high=5.0)
    assert LOSSES["cispo"].settings(config) == {"epsilon_high": 5.0}
    config = GRPOConfig(loss_type="sapo", sapo_temperature_pos=0.7)
    assert LOSSES["sapo"].settings(config) == {"tau_pos": 0.7, "tau_neg": 1.05}
    config = GRPOConfig(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=0.5)
    assert LOSSES["vespo"].settings(config) == {"k_pos": 1.5, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 0.5}
    with pytest.raises(ValueError, match="'tau_pos' of loss_type='sapo' comes from GRPOConfig.sapo_temperature_pos"):
        GRPOConfig(loss_type="sapo", loss_kwargs={"tau_pos": 2.0})
    with pytest.raises(ValueError, match="'epsilon_high' of loss_type='grpo' comes from GRPOConfig.epsilon_high"):
        GRPOConfig(loss_type="grpo", loss_kwargs={"epsilon_high": 0.3})


def test_a_decorated_loss_with_its_own_hyper_parameter_trains(tiny_model_dir, tmp_path):
    """One decorated function, no config field: `shift` reaches the loss through loss_kwargs and changes both the
    logged loss (by exactly -shift at the first step, whose rollouts are the same) and the trained weights."""
    seen = []
    try:

        @register_loss("shifted_pg", params={"shift": 0.0})
        def shifted_pg(logprobs, log_ratio, log_weights, advantages, mask, *, shift, **_):
            seen.append(shift)
            return -(advantages + shift) * torch.exp(log_weights), {"shifted_pg/shift": torch.tensor(float(shift))}

        runs = {}
        for shift in (None, 1.5):
            config = quiet_config(
                tmp_path / str(shift),
                per_device_train_batch_size=6,
                max_completion_length=6,
                learning_rate=0.05,
                max_steps=1,
                loss_type="shifted_pg",
                loss_kwargs=None if shift is None else {"shift": shift},
                bf16=False,  # fp32: the in-process sampler's tokens are not reweighted (bf16 would scale the shift)
            )
            trainer = GRPOTrainer(
                tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts(12)
            )
            seen.clear()
            trainer.train()
            (logged,) = [entry for entry in trainer.state.log_history if "loss" in entry]
            weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
            runs[shift] = (set(seen), logged, weights)
    finally:
        LOSSES.pop("shifted_pg", None)
    (default_seen, default_log, default_weights), (seen_15, log_15, weights_15) = runs[None], runs[1.5]
    assert default_seen == {0.0} and seen_15 == {1.5}  # the default, then the user's value, reached the loss
    assert log_15["shifted_pg/shift"] == 1.5
    assert log_15["loss"] == pytest.approx(default_log["loss"] - 1.5, abs=1e-4)
    assert any(not torch.allclose(default_weights[n], weights_15[n]) for n in default_weights)
