"""Built-in engine plugins: the standard engine and the pipeline engine."""
