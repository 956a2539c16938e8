"""Built-in training monitors: tensorboard, csv and wandb."""
