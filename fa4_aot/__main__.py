"""`python -m fa4_aot ...` is the `fa4-aot` command."""

from .cli import main

main(prog_name="fa4-aot")
