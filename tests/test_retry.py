"""Which failures a task retries (``tasks/retry.py``): transient ones, not a bad input."""


def test_input_errors_are_not_retried():
    import errno

    from prefect.states import Failed

    from knnssd.tasks.retry import transient

    assert not transient(None, None, Failed(data=ValueError("empty prompt")))
    assert not transient(None, None, Failed(data=FileNotFoundError("x")))
    assert not transient(None, None, Failed(data=OSError(errno.ENOSPC, "No space left on device")))
    assert transient(None, None, Failed(data=OSError("disk hiccup")))
    from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException

    # an alias MLflow refused at registration was retried twice, each try leaving a version without an alias
    assert not transient(None, None, Failed(data=MlflowException("bad alias", INVALID_PARAMETER_VALUE)))
    assert transient(None, None, Failed(data=MlflowException("database is locked")))
