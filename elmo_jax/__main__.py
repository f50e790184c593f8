import sys

from elmo_jax.cli import main

sys.exit(main())
