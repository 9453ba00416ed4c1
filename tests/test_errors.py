import inspect

import kvport.errors as errors


def test_one_tree() -> None:
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert len(classes) > 20
    for c in classes:
        assert issubclass(c, errors.KVPortError), c
        if c is not errors.KVPortError:
            assert c.__name__ in errors.__doc__, f"{c.__name__} missing from the drawn tree"


def test_user_input_errors_are_separate_from_runtime_failures() -> None:
    assert issubclass(errors.UnitError, errors.UserInputError)
    assert not issubclass(errors.TransferError, errors.UserInputError)
    assert issubclass(errors.IncompatibleSpecError, errors.TransferError)
