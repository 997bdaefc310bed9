"""Checkpoints of the streamed state: saves between steps and in the step,
links, clones and copies of the bucket files, and torch's state-dict formats."""
