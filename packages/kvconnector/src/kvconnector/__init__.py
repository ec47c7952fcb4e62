"""kvconnector."""
