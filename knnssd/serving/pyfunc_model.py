"""MLflow "models from code" entry: the file MLflow stores with each bank version and runs on load."""
import mlflow

from knnssd.serving.pyfunc import KnnSsdModel

mlflow.models.set_model(KnnSsdModel())
