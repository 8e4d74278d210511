"""No names at all: for README blocks that define everything they use."""
