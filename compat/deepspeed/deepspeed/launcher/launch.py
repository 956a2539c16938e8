"""``deepspeed.launcher.launch``: the per-node launcher (``python -m deepspeed.launcher.launch --world_info=...
script.py``) is dscore's :mod:`dscore.launcher.node`: same ``--world_info`` (url-safe base64 JSON of
``{host: [slots]}``), ``--node_rank``, ``--master_addr``, ``--master_port``, ``--module``, ``--no_python``,
``--no_local_rank``, ``--enable_each_rank_log``, ``--bind_cores_to_rank``, ``--bind_core_list``. DeepSpeed's
``--save_pid``, ``--quiet`` and ``--log_level`` flags of this module are not accepted (argparse names them;
``deepspeed --save_pid`` on the runner writes the pid file)."""

from __future__ import annotations

import sys

from dscore.launcher.node import decode_world_info, main, parse_args

__all__ = ["decode_world_info", "main", "parse_args"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
