"""Running a bank: routed generation (routed), batch generation (batch), the MLflow pyfunc model,
routing accuracy (evaluate), promotion of a candidate bank and the drop-folder watch."""
