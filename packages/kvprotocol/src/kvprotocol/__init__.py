"""kvprotocol."""
