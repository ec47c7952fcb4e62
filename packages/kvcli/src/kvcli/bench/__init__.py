"""Load generators: `kvcli bench server` (the kvserver protocol) and `kvcli bench engine` (OpenAI HTTP)."""
