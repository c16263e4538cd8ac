"""Command line: argument parsing, the rich reports, the Textual TUI and the agent wiring."""
