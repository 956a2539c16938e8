"""An example dscore model transform: freeze the parameters whose names match the ``freeze`` section's patterns."""
