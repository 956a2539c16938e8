"""deepspeed.launcher.runner's helper functions over dscore's launcher (DeepSpeed 0.19.8 signatures/types)."""

from __future__ import annotations

import base64
import collections
import json

import pytest

from dscore.errors import HostfileError, LauncherArgumentError


def test_hostfile_and_filters_have_deepspeeds_types_and_errors(tmp_path):
    from deepspeed.launcher import runner

    pool = runner._parse_hostfile(["a slots=2\n", "# c\n", "bob@b slots=4\n", "\n"])
    assert isinstance(pool, collections.OrderedDict) and list(pool.items()) == [("a", 2), ("bob@b", 4)]
    with pytest.raises(ValueError):  # duplicate host: HostfileError is a ValueError
        runner._parse_hostfile(["a slots=2", "a slots=1"])
    with pytest.raises(HostfileError):
        runner._parse_hostfile(["   "])
    assert runner.fetch_hostfile(str(tmp_path / "missing")) is None
    hf = tmp_path / "hostfile"
    hf.write_text("x slots=1\ny slots=3\n")
    assert runner.fetch_hostfile(str(hf)) == collections.OrderedDict([("x", 1), ("y", 3)])

    active = runner.parse_inclusion_exclusion({"y": 3, "x": 2}, "x@y:2,0", "")
    assert list(active.items()) == [("y", [0, 2]), ("x", [0, 1])]  # pool order, sorted slots
    assert runner.parse_resource_filter({"x": [0, 1]}, exclude_str="x") == {}
    assert runner.parse_resource_filter({"x": [0, 1, 2]}, exclude_str="x:1") == {"x": [0, 2]}
    for inc, exc in (("x", "y"), ("z", ""), ("x:5", ""), ("", "x:a")):
        with pytest.raises(LauncherArgumentError):
            runner.parse_resource_filter({"x": [0, 1]}, include_str=inc, exclude_str=exc)
    assert runner.apply_num_nodes_and_gpus({"a": [0, 1], "b": [0]}, 1, 3) == {"a": [0, 1, 2]}
    assert json.loads(base64.urlsafe_b64decode(runner.encode_world_info({"a": 4}))) == {"a": 4}
    assert json.loads(base64.urlsafe_b64decode(runner.encode_world_info({"a": (0, 1)}))) == {"a": [0, 1]}


def test_main_raises_value_error_for_counts_with_filters():
    from deepspeed.launcher import runner

    for argv in ("--num_nodes 1 -i localhost foo.py", "--num_gpus 1 -e localhost foo.py"):
        with pytest.raises(LauncherArgumentError, match="cannot be combined"):
            runner.main(argv.split())
    args = runner.parse_args(["--launcher_arg", "-x 1", "s.py", "--lr", "1"])  # abbreviation, as DeepSpeed
    assert args.launcher_args == "-x 1" and args.user_script == "s.py" and args.user_args == ["--lr", "1"]


def test_launch_module_is_dscores_node_launcher():
    from deepspeed.launcher import launch, runner

    args = launch.parse_args(["--world_info=" + runner.encode_world_info({"h": [0, 2]}), "--node_rank=0", "t.py", "-a"])
    assert args.training_script == "t.py" and args.training_script_args == ["-a"]
    assert launch.decode_world_info(args.world_info) == {"h": [0, 2]}
    with pytest.raises(SystemExit):  # DeepSpeed's --save_pid is refused by argparse, not ignored
        launch.parse_args(["--save_pid", "1", "t.py"])
