"""Command line: argument parsing, the rich reports and the Textual TUI (the running system is llmdiag.agent)."""
