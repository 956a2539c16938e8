"""dscore-example-zero: a third-party ZeRO stage 2 written against public dscore names only."""
