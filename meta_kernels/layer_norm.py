"""TODO: being written."""
