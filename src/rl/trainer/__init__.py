"""The trainer process: FSDP2 under torchrun, one optimizer step per orchestrator batch."""
