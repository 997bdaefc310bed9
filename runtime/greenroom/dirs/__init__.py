"""Directory ownership: per-rank dirs and their locks, state dirs, signals held across
a section, and the reclaim of dirs whose owner died."""
