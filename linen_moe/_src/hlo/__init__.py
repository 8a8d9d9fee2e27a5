"""Reading compiled programs: contractions' element types, collectives, the
bytes they send. Imports no jax."""
