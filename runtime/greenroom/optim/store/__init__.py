"""The bucket store: streamed optimizer state in per-bucket files, one bucket on
the device at a time."""
