"""`python -m freqact` runs the command line."""
import sys

from freqact.cli import main

sys.exit(main())
