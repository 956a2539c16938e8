"""``deepspeed.module_inject.auto_ep_presets`` (see its submodules: not provided by dscore)."""
