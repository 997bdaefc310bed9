"""The demo trainer behind ``greenroom train``: a small policy, its task, the rollout engine
and the colocated train/sleep/rollout/wake loop."""
