import sys

from phalanx_tools.cli import main

sys.exit(main())
