"""unity-pcg: joint algebraic and parallelization optimization of DNN training over parallel
computation graphs (after Unity, OSDI'22).

The Python API (:mod:`unity_pcg.api`) is importable from here; it loads its parts (and torch, for
training) only when a function is called::

    import unity_pcg as up
    res = up.optimize("model.onnx", machine="local:1x2", budget=15)
    up.train(res, "model.onnx", steps=10, loss="mse", data="train.npz", save_model="trained.onnx")
"""

__all__ = ["import_model", "optimize", "explain", "train", "export_weights", "save_model", "UnityError"]

_API = {"import_model", "optimize", "explain", "train", "export_weights", "save_model"}


def __getattr__(name):
    if name in _API:
        from . import api
        return getattr(api, name)
    if name == "UnityError":
        from .errors import UnityError
        return UnityError
    raise AttributeError(f"module 'unity_pcg' has no attribute {name!r}")
