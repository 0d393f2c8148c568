"""Limits the packer and its command line share (a module of its own: the command reads it before
the packer loads)."""

DEFAULT_MAX_FILE_BYTES = 1_048_576  # files larger than this are listed, not packed
