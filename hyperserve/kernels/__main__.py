"""`python -m hyperserve.kernels`: build the native CPU kernels now (make install runs it)."""

import logging

from hyperserve.kernels import available, build_directory, isa

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(f"native CPU kernels: {'ok, ' + isa() if available() else 'unavailable'} ({build_directory()})")
