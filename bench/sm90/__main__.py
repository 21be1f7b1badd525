"""``python -m ragattn.bench.sm90``: write the static sm_90 report (see the package's docstring)."""
from .report import main

main()
