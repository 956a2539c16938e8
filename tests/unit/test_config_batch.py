"""The batch triangle: DeepSpeed 0.19.8's derivation and dscore's explicit errors."""

from __future__ import annotations

import pytest
from test_config_fixtures import error_of, load

from dscore.config.batch import resolve_batch
from dscore.errors import ConfigError


def test_issue_examples_world_size_4() -> None:
    cfg = load({"train_batch_size": 32}, world_size=4)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (32, 8, 1)
    cfg = load({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=4)
    assert cfg.train_batch_size == 32
    err = error_of({"train_batch_size": 30}, world_size=4)
    text = str(err)
    assert err.path == "train_batch_size"
    assert "30" in text and "not divisible" in text and "world size 4" in text
    assert "world_size=4 passed to load_config" in text  # where the world size came from


@pytest.mark.parametrize(
    ("given", "world", "expected"),
    [
        (
            {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8},
            2,
            (64, 4, 8),
        ),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 2, (64, 4, 8)),
        ({"train_batch_size": 64, "gradient_accumulation_steps": 8}, 2, (64, 4, 8)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 2, (64, 4, 8)),
        ({"train_batch_size": 64}, 2, (64, 32, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 3, (12, 4, 1)),
        ({"train_batch_size": 2e2, "train_micro_batch_size_per_gpu": 25.0}, 1, (200, 25, 8)),
    ],
)
def test_derivation_table(given: dict, world: int, expected: tuple[int, int, int]) -> None:
    cfg = load(given, world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_inconsistent_three_values_show_every_value() -> None:
    err = error_of(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2
    )
    text = str(err)
    for needle in ("train_batch_size = 32", "train_micro_batch_size_per_gpu = 4", "gradient_accumulation_steps = 2"):
        assert needle in text
    assert "32 != 4 x 2 x 2 = 16" in text


def test_deepspeed_floor_case_is_explained() -> None:
    # DeepSpeed floors to GAS = 0 here and reports only "GAS > 0"; dscore names the divisibility.
    err = error_of({"train_batch_size": 33, "train_micro_batch_size_per_gpu": 17}, world_size=2)
    assert "33 is not divisible by" in str(err) and "17 x 2 = 34" in str(err)
    err = error_of({"train_batch_size": 30, "gradient_accumulation_steps": 4}, world_size=2)
    assert "gradient_accumulation_steps x world size = 4 x 2 = 8" in str(err)


@pytest.mark.parametrize(
    ("given", "path"),
    [
        ({}, "train_batch_size"),
        ({"gradient_accumulation_steps": 4}, "train_batch_size"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"train_batch_size": -8}, "train_batch_size"),
        ({"train_batch_size": True}, "train_batch_size"),
        ({"train_batch_size": "32"}, "train_batch_size"),
        ({"train_batch_size": 8.5}, "train_batch_size"),
        ({"train_batch_size": float("nan")}, "train_batch_size"),
        ({"train_batch_size": 8, "gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"train_micro_batch_size_per_gpu": [4]}, "train_micro_batch_size_per_gpu"),
    ],
)
def test_invalid_values_name_the_key(given: dict, path: str) -> None:
    err = error_of(given)
    assert err.path == path


def test_auto_is_the_third_value_only_when_two_are_concrete() -> None:
    cfg = load(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3},
        world_size=2,
    )
    assert cfg.train_batch_size == 12
    cfg = load(
        {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"},
        world_size=2,
    )
    assert cfg.gradient_accumulation_steps == 3
    err = error_of(
        {"train_batch_size": 12, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    )
    assert 'unresolved "auto"' in str(err)
    assert {p for p, _ in err.errors} == {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}


def test_world_size_source_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"world size 3 \(--world-size 3\)"):
        resolve_batch({"train_batch_size": 8}, world_size=3, world_size_source="--world-size 3", source="x.json")


@pytest.mark.parametrize("world_size", [0, -2, True, 2.0])
def test_world_size_must_be_a_positive_int(world_size: object) -> None:
    with pytest.raises(ConfigError, match="world size must be a positive integer"):
        load({"train_batch_size": 8}, world_size=world_size)
