"""The `rl` launcher: one command that starts inference, orchestrator and trainer and supervises them."""
