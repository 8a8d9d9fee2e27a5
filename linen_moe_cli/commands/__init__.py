"""The `linen-moe` subcommands, one module each.

Each module has `register(subparsers)`, which adds its parser and sets
`run` on it, and `run(args) -> int` (the exit status). Registering imports
no jax: `linen-moe --help` and every `linen-moe COMMAND --help` answer at
once; a command imports what it needs when it runs.
"""

from linen_moe_cli.commands import export
from linen_moe_cli.commands import generate
from linen_moe_cli.commands import launch
from linen_moe_cli.commands import matrix
from linen_moe_cli.commands import plan
from linen_moe_cli.commands import tokenizer
from linen_moe_cli.commands import train

# In the order `linen-moe --help` lists them.
COMMANDS = (train, export, matrix, launch, generate, plan, tokenizer)
