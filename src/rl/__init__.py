"""rl: asynchronous RL post-training."""
