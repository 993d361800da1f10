"""Commands: one module per `flashdraft` subcommand, each only `add_arguments(parser)` and
`run(args) -> int`, calling library functions. Nothing else imports this package.
"""
