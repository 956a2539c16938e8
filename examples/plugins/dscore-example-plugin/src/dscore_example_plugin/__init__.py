"""An example third-party dscore plugin (SignSGD optimizer, InverseSqrtLR scheduler)."""
