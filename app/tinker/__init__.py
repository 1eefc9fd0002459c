"""The Tinker-compatible REST surface (DESIGN §11): the official `tinker` SDK (pinned in
pyproject's dev extra) runs against loraloom. Our own models of its wire shapes; no import of
the SDK here."""
