"""Training: presets, noise schedules, dual-stream batches, losses, checkpoints and the loop."""
