"""The `loraloom` command groups, one module each; `loraloom.cli` assembles them."""
