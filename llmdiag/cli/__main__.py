import sys

from llmdiag.cli.main import main

sys.exit(main())
