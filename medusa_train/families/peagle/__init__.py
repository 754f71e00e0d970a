"""P-EAGLE: an EAGLE-3 draft that proposes K tokens in one pass (parallel drafting)."""
