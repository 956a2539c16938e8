"""Built-in optimizer plugins (Adam/AdamW, Lamb, Lion, Adagrad, Muon, OneBitAdam, OneBitLamb, SGD, torch.optim)."""
