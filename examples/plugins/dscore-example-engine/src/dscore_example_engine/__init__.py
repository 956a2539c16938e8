"""dscore-example-engine: the standard engine plus an exponential moving average of the weights."""
