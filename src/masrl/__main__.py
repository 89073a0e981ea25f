import sys

from masrl.cli import main

sys.exit(main())
