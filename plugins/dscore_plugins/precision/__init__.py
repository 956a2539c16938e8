"""Built-in precision plugins: fp32, fp16 (static and dynamic loss scaling) and bf16."""
