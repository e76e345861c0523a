"""Small utilities every layer may use: paths, optional extras, key files, the essays, result files,
plots, Pareto fronts, calibrated files, and the weights fingerprint that names a model."""
