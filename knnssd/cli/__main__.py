import sys

from knnssd.cli import main

sys.exit(main())
