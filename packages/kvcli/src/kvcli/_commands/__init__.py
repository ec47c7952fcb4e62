"""One module per `kvcli` subcommand, each exposing `command`; loaded only when invoked."""
