"""ENorm (minimise Σ c_i |θ_i|^p over the rescalings) and the canonical
representative (every unit's incoming weights of unit norm)."""

from pathir.enorm.run import ENormReport, NormalizeReport, enorm, normalize_units
from pathir.enorm.solver import ENormResult, solve_enorm

__all__ = ["enorm", "normalize_units", "ENormReport", "NormalizeReport", "solve_enorm", "ENormResult"]
