"""kvcli."""
