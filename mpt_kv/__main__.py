import sys

from mpt_kv.cli import main

sys.exit(main())
