"""Finding each cluster's fastest drafting configuration: the Optuna proxy and real stages
(optimize), the calibration steps the flows call (calibration) and bank growth (extend)."""
