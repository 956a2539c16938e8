"""``dscore.add_config_arguments`` makes a script accept the ``--local_rank=N`` that ``dscore run`` passes."""

from __future__ import annotations

import argparse

import pytest

import dscore
from dscore.config.arguments import add_local_rank_argument
from dscore.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    return dscore.add_config_arguments(argparse.ArgumentParser(prog="train.py"))


@pytest.mark.parametrize("argv", [["--local_rank=1"], ["--local-rank=1"], ["--local_rank", "1"], ["--local-rank", "1"]])
def test_both_spellings_reach_local_rank(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = _parser().parse_args([*argv, "--deepspeed_config", "ds.json"])
    assert args.local_rank == 1 and args.deepspeed_config == "ds.json"


def test_default_is_env_local_rank_else_minus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _parser().parse_args([]).local_rank == -1
    monkeypatch.setenv("LOCAL_RANK", "3")  # torchrun / `dscore run --no_local_rank` pass it only here
    assert _parser().parse_args([]).local_rank == 3
    assert _parser().parse_args(["--local_rank", "0"]).local_rank == 0  # the flag wins over the environment


def test_bad_env_local_rank_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ConfigError, match=r"LOCAL_RANK='first'.*not an integer"):
        _parser()


def test_not_a_number_is_an_argparse_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["--local_rank", "x"])
    assert info.value.code == 2 and "--local_rank" in capsys.readouterr().err


def test_scripts_own_flag_is_kept_and_the_other_spelling_aliases_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "5")
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=7, dest="my_rank")
    dscore.add_config_arguments(parser)
    assert parser.parse_args([]).my_rank == 7  # the script's default, not $LOCAL_RANK
    assert parser.parse_args(["--local-rank=2"]).my_rank == 2
    assert parser.parse_args(["--local_rank=4"]).my_rank == 4
    assert "local_rank" not in vars(parser.parse_args([]))
    assert "--local-rank" not in parser.format_help()  # the alias is hidden; the script's help is unchanged


def test_both_spellings_declared_means_no_change() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    before = list(parser._actions)
    add_local_rank_argument(parser, environ={})
    assert parser._actions == before


def test_a_store_true_flag_of_that_name_is_left_alone() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", action="store_true")
    add_local_rank_argument(parser, environ={})
    with pytest.raises(SystemExit):
        parser.parse_args(["--local-rank=1"])


def test_local_rank_is_outside_the_deepspeed_group() -> None:
    parser = _parser()
    group = next(g for g in parser._action_groups if g.title == "DeepSpeed")
    assert not any("--local_rank" in a.option_strings for a in group._group_actions)
    assert "--local_rank N, --local-rank N" in parser.format_help()
