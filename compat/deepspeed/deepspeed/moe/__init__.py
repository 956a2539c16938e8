"""``deepspeed.moe`` on :mod:`dscore.moe` (import ``deepspeed.moe.layer`` / ``deepspeed.moe.utils``)."""
