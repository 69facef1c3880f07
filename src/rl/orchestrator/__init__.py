"""The orchestrator: loads verifiers environments, runs groups of rollouts against inference, scores
them, computes advantages and writes one batch per trainer step."""
