"""kvserver."""
