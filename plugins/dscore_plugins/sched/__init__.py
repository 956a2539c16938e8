"""Built-in LR scheduler plugins: DeepSpeed's five schedulers and any ``torch.optim.lr_scheduler`` class."""
