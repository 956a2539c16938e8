"""The four source forms, Hjson, duplicate keys, argparse integration."""

from __future__ import annotations

import argparse
import base64
import json
import pathlib

import pytest
from test_config_fixtures import load

from dscore.config import add_config_arguments
from dscore.errors import ConfigError

CONFIG = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 1}}


def _b64(obj: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode()


def test_dict_source_is_not_mutated() -> None:
    given = {"train_batch_size": 16, "bfloat16": {"enabled": True}}
    cfg = load(given)
    assert given == {"train_batch_size": 16, "bfloat16": {"enabled": True}}
    assert cfg.source_name == "<dict>" and cfg.bf16_enabled
    assert cfg.raw == {"train_batch_size": 16, "bf16": {"enabled": True}}  # after migration


def test_str_path_and_pathlib_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    for source in (str(path), path):
        cfg = load(source, world_size=2)
        assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.zero_stage == 1
        assert cfg.source_name == str(path)


def test_base64_source() -> None:
    cfg = load(_b64(CONFIG), world_size=2)
    assert cfg.gradient_accumulation_steps == 2 and cfg.source_name == "<base64>"
    padless = _b64(CONFIG).rstrip("=")
    assert load(padless, world_size=2).train_batch_size == 16


def test_hjson_comments_trailing_commas_unquoted_keys(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds.hjson"
    path.write_text(
        """
        {
          # a hash comment
          // a line comment
          /* a block comment */
          train_batch_size: 8,
          "fp16": {"enabled": true,},
        }
        """
    )
    cfg = load(path)
    assert cfg.train_batch_size == 8 and cfg.fp16_enabled


def test_duplicate_keys_are_rejected(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match=r"duplicate keys.*\['stage'\]") as info:
        load(path)
    assert info.value.source == str(path)


def test_syntax_error_reports_line(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n "train_batch_size": 8,\n "fp16": {"enabled": tru\n}')
    with pytest.raises(ConfigError, match="line"):
        load(path)


@pytest.mark.parametrize("text", ["[1, 2]", '"just a string"', "42"])
def test_top_level_must_be_object(tmp_path: pathlib.Path, text: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="JSON object"):
        load(path)


def test_missing_file_and_garbage_string() -> None:
    with pytest.raises(ConfigError, match="not found"):
        load(pathlib.Path("/nonexistent/ds_config.json"))
    with pytest.raises(ConfigError, match="no such file, and not base64"):
        load("/nonexistent/ds_config.json")
    with pytest.raises(ConfigError, match="not base64"):
        load("%%%not base64%%%")
    with pytest.raises(ConfigError, match="cannot read a ds_config from a int"):
        load(42)


def test_namespace_sources(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True
    assert load(args, world_size=2).train_batch_size == 16
    legacy = parser.parse_args(["--deepscale_config", str(path)])
    cfg = load(legacy, world_size=2)
    assert any("--deepscale_config is deprecated" in w for w in cfg.warnings)
    both = parser.parse_args(["--deepspeed_config", str(path), "--deepscale_config", "other.json"])
    with pytest.raises(ConfigError) as info:
        load(both)
    assert "--deepspeed_config" in str(info.value) and "--deepscale_config" in str(info.value)
    assert str(path) in str(info.value) and "other.json" in str(info.value)
    with pytest.raises(ConfigError, match="--deepspeed_config"):
        load(parser.parse_args([]))


def test_add_config_arguments_defaults_match_deepspeed() -> None:
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    args = parser.parse_args([])
    assert (args.deepspeed, args.deepspeed_config, args.deepscale, args.deepscale_config) == (False, None, False, None)
    group = next(g for g in parser._action_groups if g.title == "DeepSpeed")
    flags = sorted(opt for action in group._group_actions for opt in action.option_strings)
    assert flags == ["--deepscale", "--deepscale_config", "--deepspeed", "--deepspeed_config"]


def test_python_dict_with_non_string_key() -> None:
    with pytest.raises(ConfigError, match="keys must be strings") as info:
        load({"train_batch_size": 8, "fp16": {1: True}})
    assert info.value.path == "fp16"
