"""``llmdiag top``: the interactive diagnosis TUI (Textual). See :mod:`llmdiag.cli.tui.app`."""
