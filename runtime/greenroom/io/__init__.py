"""The disk I/O engine: state files, checksums, frames and codecs, filesystem facts,
and the atomic publish of a checkpoint directory."""
