"""Imported by the multiprocessing forkserver (preload) so that every forked reward worker starts warm.

Why: a spawned worker spends ~1 s (10+ s on a loaded node) importing sympy and math-verify's LaTeX parser.
Forked from a server that already did it once, a replacement for a killed worker is ready in milliseconds,
so a timeout costs one case, not a stall of the pool. Must never raise: the forkserver would die with it.
"""

import logging
import warnings

# Forked workers re-run the main module (already imported here by name, see pool._preload_modules); runpy
# then warns once per worker that the module is in sys.modules. Expected, so silenced (filters are inherited).
warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning)

try:
    from mcore_rl.rewards.worker import WorkerOptions, verify_case

    logging.getLogger("math_verify").setLevel(logging.CRITICAL)

    verify_case("\\boxed{1}", "1", WorkerOptions())
except Exception:  # noqa: BLE001 - a cold worker is still a correct worker
    pass
