"""`python -m pallas_kernels.native`: build the native CPU kernels into their cache and say which path runs."""
import sys

from pallas_kernels.native import main

sys.exit(main())
