import sys

from phalanx._cli import main

sys.exit(main())
