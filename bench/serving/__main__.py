"""`python -m bench.serving`: the serving benchmark (bench/serving/run.py)."""

import sys

from bench.serving.run import main

sys.exit(main())
