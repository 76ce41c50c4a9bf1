"""CLI subcommands; each module exposes HELP, add_arguments(parser) and run(args)."""
