import sys

from dscluster.cli import main

sys.exit(main())
